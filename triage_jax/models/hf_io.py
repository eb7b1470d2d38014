"""HF safetensors import/export for Qwen3 / Qwen3-MoE.

Loading builds the model abstractly (`nnx.eval_shape`) and fills it tensor by tensor from `safe_open`, so the
checkpoint is never held twice in memory. HF stores linear weights [out, in]; ours are [in, out] (attention kernels
keep their head axes, e.g. q_proj w_dnh), so they are transposed (and reshaped) on the way in and out.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from triage_jax.models.config import ModelConfig
from triage_jax.models.qwen3 import Qwen3, prequantize_model
from triage_jax.quant import PrecisionPolicy, QuantizedWeight

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFCheckpointError(ValueError):
    """An HF checkpoint file is unreadable (truncated safetensors, broken JSON); the message names the file."""


def _safe_open(path: str):
    try:
        return safe_open(path, "numpy")
    except Exception as e:  # SafetensorError, OSError: truncated, empty or not a safetensors file
        raise HFCheckpointError(f"cannot read safetensors file {path}: {e} (truncated or not a safetensors "
                                f"file? re-download it)") from None


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return data


def hf_tensor_map(model: Qwen3) -> Iterator[tuple[str, object, str, tuple[int, ...]]]:
    """(HF key, our module or variable, kind, index) for every checkpoint tensor of `model`.

    kind: "copy" (same layout), "linear" (HF [out, in] <-> our kernel [*in, *out]), "expert" (one expert's
    [out, in] <-> kernel[..., e, :, :] [in, out]). index selects the tensor inside a stacked variable: (layer,)
    for scanned layers, plus the expert for "expert"; () when the variable is the tensor itself.
    """
    cfg = model.cfg
    yield "model.embed_tokens.weight", model.embed.embedding, "copy", ()
    for i in range(cfg.num_hidden_layers):
        layer, at = (model.layers, (i,)) if cfg.scan_layers else (model.layers[i], ())
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", layer.input_norm.weight, "copy", at
        yield p + "post_attention_layernorm.weight", layer.post_attention_norm.weight, "copy", at
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield p + f"self_attn.{name}.weight", getattr(layer.attn, name), "linear", at
        yield p + "self_attn.q_norm.weight", layer.attn.q_norm.weight, "copy", at
        yield p + "self_attn.k_norm.weight", layer.attn.k_norm.weight, "copy", at
        if layer.mlp is not None:
            for name in ("gate_proj", "up_proj", "down_proj"):
                yield p + f"mlp.{name}.weight", getattr(layer.mlp, name), "linear", at
        else:
            yield p + "mlp.gate.weight", layer.moe.router, "linear", at
            for e in range(cfg.num_experts):
                for name in ("gate_proj", "up_proj", "down_proj"):
                    yield p + f"mlp.experts.{e}.{name}.weight", getattr(layer.moe.experts, name), "expert", at + (e,)
    yield "model.norm.weight", model.final_norm.weight, "copy", ()
    if model.lm_head is not None:
        yield "lm_head.weight", model.lm_head, "linear", ()


def _variable(target, kind: str):
    return target if kind == "copy" else target.kernel


def _hf_shape(target, kind: str, index: tuple[int, ...]) -> tuple[int, ...]:
    """The tensor's shape in the HF checkpoint."""
    if kind == "linear":
        k, n = target.kn
        return (n, k)
    shape = tuple(_variable(target, kind).get_value().shape)[len(index):]
    return shape if kind == "copy" else (shape[1], shape[0])


class _Checkpoint:
    """Key -> file lookup over a single or sharded safetensors checkpoint, opening each file once."""

    def __init__(self, path: str):
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            data = _read_json(index)
            if not isinstance(data.get("weight_map"), dict):
                raise HFCheckpointError(f"{index} has no 'weight_map' object")
            self.weight_map = dict(data["weight_map"])
            for fname in sorted(set(self.weight_map.values())):
                if not os.path.isfile(os.path.join(path, fname)):
                    raise HFCheckpointError(f"{index} names {fname}, which is not in {path}")
        else:
            files = [SINGLE_FILE] if os.path.exists(os.path.join(path, SINGLE_FILE)) else sorted(
                f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors in {path}")
            self.weight_map = {}
            for fname in files:
                with _safe_open(os.path.join(path, fname)) as f:
                    self.weight_map.update({k: fname for k in f.keys()})
        self.path, self._open = path, {}

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def get(self, key: str) -> np.ndarray:
        if key not in self.weight_map:
            raise KeyError(f"checkpoint {self.path} is missing key {key!r}")
        fname = self.weight_map[key]
        file = os.path.join(self.path, fname)
        if fname not in self._open:
            self._open[fname] = _safe_open(file).__enter__()
        try:
            return self._open[fname].get_tensor(key)
        except Exception as e:  # a tensor whose bytes are missing or malformed
            raise HFCheckpointError(f"cannot read tensor {key!r} from safetensors file {file}: {e}") from None

    def close(self):
        for f in self._open.values():
            f.__exit__(None, None, None)
        self._open.clear()


def _checked(ckpt: _Checkpoint, key: str, shape: tuple[int, ...]) -> np.ndarray:
    t = ckpt.get(key)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"checkpoint key {key!r}: shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def load_hf_weights(model: Qwen3, path: str) -> Qwen3:
    """Fill `model` (possibly abstract, from nnx.eval_shape) in place from the safetensors under `path`.

    A variable that gathers several checkpoint tensors (stacked experts or layers) is assembled in one host buffer
    and moved to the device once complete, so peak memory is the model plus one variable.
    """
    cfg, ckpt = model.cfg, _Checkpoint(path)
    pdt = jnp.dtype(cfg.param_dtype)
    used: set[str] = set()
    pending: dict[int, list] = {}  # id(variable) -> [variable, host buffer, fills left]
    try:
        for key, target, kind, index in hf_tensor_map(model):
            t = _checked(ckpt, key, _hf_shape(target, kind, index))
            used.add(key)
            var = _variable(target, kind)
            if kind == "linear":
                t = t.T.reshape(target.in_dims + target.out_dims)
            elif kind == "expert":
                t = t.T
            if not index:
                var.set_value(jnp.asarray(t, pdt))
                continue
            entry = pending.get(id(var))
            if entry is None:
                shape = tuple(var.get_value().shape)
                entry = pending[id(var)] = [var, np.empty(shape, t.dtype), int(np.prod(shape[: len(index)]))]
            entry[1][index] = t
            entry[2] -= 1
            if entry[2] == 0:
                var.set_value(jnp.asarray(entry[1], pdt))
                del pending[id(var)]
    finally:
        ckpt.close()
    assert not pending, "every stacked variable is filled by its keys"
    extra = sorted(k for k in ckpt.keys() - used
                   if not k.endswith(IGNORED_SUFFIXES) and not (k == "lm_head.weight" and model.lm_head is None))
    if extra:
        raise ValueError(f"checkpoint {path} has {len(extra)} unexpected key(s) for this config, e.g. {extra[:5]}")
    return model


def from_pretrained(path: str | os.PathLike, *, dtype: str = "float32", param_dtype: str | None = None,
                    policy: PrecisionPolicy | None = None, **config_overrides) -> Qwen3:
    """Load an HF Qwen3 / Qwen3-MoE checkpoint directory (config.json + safetensors, single or sharded).

    dtype is the compute dtype (param_dtype defaults to it). With a policy, the returned model's quantized-weight
    kernels are pre-quantized once (`prequantize_model`), for the sampler.
    """
    path = os.fspath(path)
    cfg_file = path if path.endswith(".json") else os.path.join(path, "config.json")
    _read_json(cfg_file)  # a broken config.json names itself
    try:
        cfg = ModelConfig.from_hf_config(path, dtype=dtype, param_dtype=param_dtype or dtype, **config_overrides)
    except (KeyError, TypeError, ValueError) as e:
        raise HFCheckpointError(f"{cfg_file} is not a usable Qwen3 config ({type(e).__name__}: {e})") from None
    model = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0)))
    load_hf_weights(model, path)
    return model if policy is None else prequantize_model(model, policy)


def hf_state_dict(model: Qwen3) -> Iterator[tuple[str, np.ndarray]]:
    """(HF key, host array in HF layout) one tensor at a time; experts are split into per-expert keys."""
    for key, target, kind, index in hf_tensor_map(model):
        if target is None:  # merged into one GEMM with its siblings (layers.MergedLinear): a sampler's copy
            raise ValueError(f"save_pretrained: {key} is pre-quantized (merged); save the high-precision model instead")
        w = _variable(target, kind).get_value()
        if isinstance(w, QuantizedWeight):
            raise ValueError(f"save_pretrained: {key} is pre-quantized; save the high-precision model instead")
        w = np.asarray(w[index] if index else w)
        if kind == "linear":
            k, n = target.kn
            w = w.reshape(k, n).T
        elif kind == "expert":
            w = w.T
        yield key, np.ascontiguousarray(w)


def save_pretrained(model: Qwen3, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write HF-compatible config.json + safetensors (sharded with an index above max_shard_bytes)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.cfg.to_hf_config(), f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size, total = 0, 0
    tmp_names = []

    def flush():
        name = f"model-{len(tmp_names) + 1:05d}.safetensors.tmp"
        save_file(shards[-1], os.path.join(path, name), metadata={"format": "pt"})
        tmp_names.append((name, list(shards[-1])))
        shards[-1] = {}

    for key, w in hf_state_dict(model):
        if shards[-1] and size + w.nbytes > max_shard_bytes:
            flush()
            size = 0
        shards[-1][key] = w
        size += w.nbytes
        total += w.nbytes
    if shards[-1] or not tmp_names:
        flush()
    n = len(tmp_names)
    if n == 1:
        os.replace(os.path.join(path, tmp_names[0][0]), os.path.join(path, SINGLE_FILE))
        stale = os.path.join(path, INDEX_FILE)
        if os.path.exists(stale):
            os.remove(stale)
        return
    if os.path.exists(os.path.join(path, SINGLE_FILE)):
        os.remove(os.path.join(path, SINGLE_FILE))
    weight_map = {}
    for i, (tmp, keys) in enumerate(tmp_names):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(path, tmp), os.path.join(path, final))
        weight_map.update({k: final for k in keys})
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

