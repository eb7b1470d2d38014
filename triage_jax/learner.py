"""The GRPO learner: log-prob recompute, corrections, loss and diagnostics, and the optax update, on a mesh.

Functional: the model is split once into a static graphdef and a parameter pytree; every compiled function
takes parameters (sharded by the logical-axis rules) and a batch (sharded over the data axes). One mini-batch
update is one compiled call that scans over its micro-batches and accumulates exact gradients: each
micro-batch's unreduced loss sum is divided by the mini-batch denominator computed up front.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec as P

from triage_jax import sharding as shd
from triage_jax.logprobs import response_logprobs
from triage_jax.quant import PrecisionPolicy
from triage_jax.rl import corrections as corr
from triage_jax.rl import diagnostics, grpo
from triage_jax.rl.delta import DELTA_SOURCES, delta_anchor, delta_parts, select_delta, token_delta
from triage_jax.rl.triage import TriageConfig, repair_loss_sum

F32 = jnp.float32


@struct.dataclass
class RolloutBatch:
    """N responses laid out as [left-padded prompt (P) | response (R)]; S = P + R."""

    input_ids: jax.Array  # int32 [N, S]
    attn_mask: jax.Array  # bool [N, S]: real prompt and response tokens
    resp_mask: jax.Array  # float32 [N, R]: real response tokens
    adv: jax.Array  # float32 [N]
    sampler_logp: jax.Array  # float32 [N, R]
    old_logp: jax.Array  # float32 [N, R] (learner, before the update)
    ref_logp: jax.Array  # float32 [N, R] (reference policy; zeros when the KL term is off)
    weights: jax.Array  # float32 [N, R] correction weights (TRIAGE alpha, TIS, ...)
    loss_mask: jax.Array  # float32 [N, R] resp_mask with the correction's dropped tokens zeroed
    # float32 [N, R] l_ref of the delta the correction acts on (rl.delta_source: delta = old_logp - l_ref,
    # rl.delta.delta_anchor); TRIAGE's repair term measures mean(l_th - l_ref). The sampler's log-probs by default.
    anchor_logp: jax.Array
    routing: jax.Array | None = None  # int [N, S, L_moe, k] the sampler's expert ids, replayed (R3); None: off

    @property
    def resp_len(self) -> int:
        return self.resp_mask.shape[1]

    @property
    def num(self) -> int:
        return self.input_ids.shape[0]


def batch_logprobs(model, input_ids, attn_mask, resp_len: int, *, policy, temperature, vocab_chunk, routing=None):
    """(logp [N, R], entropy [N, R], MoE aux loss) of the response part of [prompt (P) | response (R)] rows;
    routing [N, S, L_moe, k] (or None) replays the sampler's MoE expert ids."""
    p = input_ids.shape[1] - resp_len
    return response_logprobs(model, input_ids[:, :p], attn_mask[:, :p], input_ids[:, p:], attn_mask[:, p:],
                             policy=policy, temperature=temperature, vocab_chunk=vocab_chunk, return_entropy=True,
                             return_aux=True, routing_bslk=routing)


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    """AdamW hyperparameters (`build.optim` reads them from `config.optim`)."""

    lr: float = 1e-4
    warmup_steps: int = 5
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0


def make_optimizer(o: OptimSettings) -> optax.GradientTransformation:
    """AdamW with linear warm-up and global-norm clipping; non-finite updates are skipped (and counted)."""
    # Linear warm-up lr*(k+1)/W over the first W updates (never a zero-lr first update), then constant.
    w = max(int(o.warmup_steps), 1)
    sched = optax.join_schedules([optax.linear_schedule(o.lr / w, o.lr, w - 1) if w > 1 else
                                  optax.constant_schedule(o.lr), optax.constant_schedule(o.lr)], [w])
    tx = optax.chain(
        optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity(),
        optax.adamw(sched, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay),
    )
    # The trainer stops the run after train.max_nonfinite consecutive skips; never apply a NaN update.
    return optax.apply_if_finite(tx, max_consecutive_errors=1 << 30)


def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def _guard_finite(params, opt_state, new_params, new_opt_state):
    """(new params, new optimizer state) when both are finite, else the old ones with apply_if_finite's
    counters advanced as for a non-finite gradient (streak +1, last_finite False, total +1)."""
    ok = _all_finite(new_params) & _all_finite(new_opt_state.inner_state)
    rejected = new_opt_state._replace(
        inner_state=opt_state.inner_state,
        notfinite_count=opt_state.notfinite_count + 1,
        last_finite=jnp.array(False),
        total_notfinite=opt_state.total_notfinite + 1,
    )
    return jax.tree.map(lambda new, old: jnp.where(ok, new, old), (new_params, new_opt_state),
                        (params, rejected))


def nonfinite_count(opt_state) -> jax.Array:
    """Consecutive skipped (non-finite) updates, from optax.apply_if_finite's state."""
    return opt_state.notfinite_count


def update_count(opt_state) -> jax.Array:
    """Optimizer steps applied so far (AdamW's step counter): the update index k of the lr warm-up and of the
    TRIAGE repair warm-up. Skipped updates (empty or non-finite) do not count."""
    (_, count), *_ = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return count


@dataclasses.dataclass(frozen=True)
class Correction:
    """A mismatch correction: its `rl.corrections.CORRECTIONS` key and its config dataclass."""

    name: str
    cfg: Any


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Everything static the loss needs (hashable: part of the compiled step's cache key)."""

    eps_low: float
    eps_high: float
    dual_clip: float | None
    agg: str
    kl_coef: float
    temperature: float
    vocab_chunk: int
    triage: TriageConfig | None  # repair term on when the correction is TRIAGE
    aux_coef: float


def micro_loss(model, mb: RolloutBatch, step, denom, rep_count, tokens, s: LossSettings, policy):
    """Loss contribution of one micro-batch: its sums over the mini-batch denominators (exact accumulation)."""
    logp, _, aux = batch_logprobs(model, mb.input_ids, mb.attn_mask, mb.resp_len, policy=policy,
                                  temperature=s.temperature, vocab_chunk=s.vocab_chunk, routing=mb.routing)
    pl_sum, _, m = grpo.policy_loss(logp, mb.old_logp, mb.adv, mb.loss_mask, eps_low=s.eps_low,
                                    eps_high=s.eps_high, dual_clip=s.dual_clip, weights=mb.weights, agg=s.agg,
                                    max_len=mb.resp_len)
    loss = pl_sum / denom
    terms = {"policy_loss": loss}
    if s.kl_coef:
        kl_sum, _ = grpo.aggregate(grpo.k3_kl(logp, mb.ref_logp, mb.loss_mask), mb.loss_mask, s.agg,
                                   max_len=mb.resp_len)
        terms["kl_loss"] = s.kl_coef * kl_sum / denom
        loss = loss + terms["kl_loss"]
    if s.triage is not None:
        rep_sum, _ = repair_loss_sum(mb.adv, logp, mb.anchor_logp, mb.resp_mask, step, s.triage)
        terms["repair_loss"] = rep_sum / jnp.maximum(rep_count, 1.0)
        loss = loss + terms["repair_loss"]
    if s.aux_coef:
        # A per-micro-batch mean: weight it by this micro-batch's share of the mini-batch tokens.
        # (A micro-batch without a token adds exactly 0, whatever its router statistics over padding are.)
        mb_tokens = jnp.sum(mb.loss_mask)
        terms["moe_aux_loss"] = jnp.where(mb_tokens > 0, s.aux_coef * aux * mb_tokens / tokens, 0.0)
        loss = loss + terms["moe_aux_loss"]
    return loss, (terms, m)


class Learner:
    """Holds the sharded parameters and optimizer state; compiles recompute, corrections and update once per shape.

    Takes typed settings only (`triage_jax.build.learner` makes them from a config): the loss settings, the
    correction, TRIAGE's thresholds for the diagnostics, the optimizer, the precision policy, the mesh, and which
    delta of a stale rollout the correction acts on (`delta_source`, one of `rl.delta.DELTA_SOURCES`).
    """

    def __init__(self, model: nnx.Module, *, loss: LossSettings, correction: Correction, triage: TriageConfig,
                 optim: OptimSettings, policy: PrecisionPolicy, micro_batch: int, mesh, rules=shd.DEFAULT_RULES,
                 abstract: bool = False, delta_source: str = "total"):
        """abstract=True (with a model from `nnx.eval_shape`): params and optimizer state are sharded
        ShapeDtypeStructs, nothing is allocated; use `lower_update` (the memory dry-run)."""
        if delta_source not in DELTA_SOURCES:
            raise ValueError(f"Learner(delta_source={delta_source!r}): not one of {list(DELTA_SOURCES)}")
        self.delta_source = delta_source
        self.mesh = mesh
        self.rules = rules
        self.policy = policy
        self.settings = loss
        self.correction = correction
        self.triage = triage
        self.micro = int(micro_batch)
        self.version = 0  # update() calls on these parameters (the trainer's "still at the step boundary" test)
        self.graphdef, params = nnx.split(model, nnx.Param)
        self.param_shardings = shd.state_shardings(params, self.mesh, self.rules)
        self.tx = make_optimizer(optim)
        # Moments shard like their parameters (jit alone would replicate tx.init's zeros on every device).
        self.opt_shardings = shd.optimizer_shardings(jax.eval_shape(self.tx.init, params), params,
                                                     self.param_shardings, self.mesh)
        if abstract:
            self.params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                                       self.param_shardings)
            self.opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                          jax.eval_shape(self.tx.init, params), self.opt_shardings)
        else:
            self.params = jax.device_put(params, self.param_shardings)
            self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)
        self._logprobs = jax.jit(self._logprobs_impl, static_argnums=(3,))
        self._compile_correction()

    def _compile_correction(self):
        """(Re)build the jitted functions that read the correction or the loss settings."""
        self._update = jax.jit(self._update_impl, donate_argnums=(0, 1))
        self._loss_and_grads = jax.jit(self._loss_and_grads_impl)
        self._prepare = jax.jit(functools.partial(prepare, correction=self.correction, triage=self.triage,
                                                  delta_source=self.delta_source))

    def set_correction(self, correction: Correction, loss: LossSettings) -> None:
        """Switch to `correction` (with the loss settings it implies: TRIAGE's repair term) from the next
        `prepare` / `update` on; parameters and optimizer state are kept. Recompiles on next use."""
        self.correction, self.settings = correction, loss
        self._compile_correction()

    # ------------------------------------------------------------------------------------------ sharding
    def shard_batch(self, tree):
        """Put [N, ...] arrays on the mesh, N split over the data axes."""
        return jax.tree.map(lambda x: jax.device_put(x, shd.batch_sharding(self.mesh, x.ndim, self.rules)), tree)

    def model(self, params=None) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params if params is None else params)

    @property
    def num_updates(self) -> int:
        """Optimizer steps applied so far (see `update_count`)."""
        return int(update_count(self.opt_state))

    # ------------------------------------------------------------------------------------------ recompute
    def _logprobs_impl(self, params, input_ids, attn_mask, resp_len: int, routing=None):
        n = input_ids.shape[0]
        k = max(1, n // self.micro)

        def one(args):
            ids, am, rt = args
            # Variables of the map body's own trace level (jax.tree.map makes new ones): nnx.scan (scan_layers)
            # refuses a module whose variables belong to an outer trace.
            model = nnx.merge(self.graphdef, jax.tree.map(lambda v: v, params))
            logp, ent, _ = batch_logprobs(model, ids, am, resp_len, policy=self.policy,
                                          temperature=self.settings.temperature,
                                          vocab_chunk=self.settings.vocab_chunk, routing=rt)
            return logp, ent

        ids, am, rt = jax.tree.map(lambda x: x.reshape(k, n // k, *x.shape[1:]), (input_ids, attn_mask, routing))
        logp, ent = jax.lax.map(one, (ids, am, rt))
        return logp.reshape(n, resp_len), ent.reshape(n, resp_len)

    def logprobs(self, input_ids, attn_mask, resp_len: int, params=None, routing=None):
        """Learner log-probs and entropies of the response tokens, in micro-batches, without gradient; routing
        (int [N, S, L_moe, k], or None) replays the sampler's MoE expert ids."""
        if input_ids.shape[0] % self.micro and input_ids.shape[0] > self.micro:
            raise ValueError(f"batch {input_ids.shape[0]} is not a multiple of rl.micro_batch={self.micro}")
        ids, am, rt = self.shard_batch((input_ids, attn_mask, routing))
        with shd.activate(self.mesh, self.rules):  # activation sharding constraints, MoE expert parallelism
            return self._logprobs(self.params if params is None else params, ids, am, resp_len, rt)

    # ------------------------------------------------------------------------------------------ corrections
    def prepare(self, *, input_ids, attn_mask, resp_mask, adv, sampler_logp, old_logp, ref_logp, routing=None,
                behaviour_logp=None, null_key=None) -> tuple[RolloutBatch, dict[str, jax.Array], jax.Array]:
        """The learner's correction and the mismatch diagnostics, in one compiled call (see `prepare`); routing
        (or None) rides along in the batch for the updates to replay; behaviour_logp (the learner's log-probs at
        the weights that sampled a stale rollout, or None: a synchronous one) splits the mismatch; null_key (or
        None) adds the direction signals' permutation nulls."""
        return self._prepare(jnp.asarray(input_ids), jnp.asarray(attn_mask), jnp.asarray(resp_mask),
                             jnp.asarray(adv), jnp.asarray(sampler_logp), jnp.asarray(old_logp),
                             jnp.asarray(ref_logp), None if routing is None else jnp.asarray(routing),
                             None if behaviour_logp is None else jnp.asarray(behaviour_logp), null_key=null_key)

    # ------------------------------------------------------------------------------------------ update
    def _loss_and_grads_impl(self, params, mb_all: RolloutBatch, step):
        """(loss, terms, metric sums, grads) of a mini-batch, accumulated exactly over its micro-batches."""
        s = self.settings
        n = mb_all.num
        k = n // self.micro
        # Denominators of the whole mini-batch (parameter-free), so micro-batch sums accumulate exactly.
        _, denom = grpo.aggregate(jnp.zeros_like(mb_all.loss_mask), mb_all.loss_mask, s.agg,
                                  max_len=mb_all.resp_len)
        denom = jnp.maximum(denom, 1.0)
        # The repair term averages over positive-advantage responses holding a real token (docs/rl_math.md).
        rep_count = jnp.sum(((mb_all.adv > 0) & (jnp.sum(mb_all.resp_mask, axis=1) > 0)).astype(F32))
        batch_spec = shd.logical_to_mesh(("batch",), self.rules, self.mesh)
        micro = jax.tree.map(
            lambda x: jax.lax.with_sharding_constraint(
                x.reshape(k, self.micro, *x.shape[1:]),
                NamedSharding(self.mesh, P(None, *batch_spec, *([None] * (x.ndim - 1)))),
            ),
            mb_all,
        )
        total_tokens = jnp.maximum(jnp.sum(mb_all.loss_mask), 1.0)

        def grad_of(mb):
            def f(p):
                model = nnx.merge(self.graphdef, p)
                return micro_loss(model, mb, step, denom, rep_count, total_tokens, s, self.policy)

            return jax.value_and_grad(f, has_aux=True)(params)

        def body(acc, mb):
            (loss, (terms, metric_sums)), g = grad_of(mb)
            return jax.tree.map(jnp.add, acc, (loss, terms, metric_sums, g)), None

        shapes = jax.eval_shape(lambda: grad_of(jax.tree.map(lambda x: x[0], micro)))
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), (shapes[0][0], *shapes[0][1], shapes[1]))
        return jax.lax.scan(body, zeros, micro)[0]

    def loss_and_grads(self, mb: RolloutBatch):
        """(loss, loss terms, metric means, gradient) of a mini-batch at the current parameters and update count:
        exactly what `update` steps on (for tests and gradient analysis)."""
        mb = self.shard_batch(mb)
        with shd.activate(self.mesh, self.rules):
            loss, terms, metric_sums, grads = self._loss_and_grads(self.params, mb, update_count(self.opt_state))
        return loss, terms, grpo.metric_means(metric_sums), grads

    def _update_impl(self, params, opt_state, mb_all: RolloutBatch):
        # The update index k (TRIAGE's repair warm-up) is the optimizer's own count of applied steps.
        loss, terms, metric_sums, grads = self._loss_and_grads_impl(params, mb_all, update_count(opt_state))
        gnorm = optax.tree.norm(grads)
        updates, new_opt_state = self.tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # apply_if_finite checks the gradients only: an lr of inf (or an overflow inside AdamW) passes that and
        # still makes the new parameters or moments non-finite. Such a new state is never applied; it counts in
        # the same non-finite streak as a non-finite gradient.
        new_params, new_opt_state = _guard_finite(params, opt_state, new_params, new_opt_state)
        # A mini-batch without a real token (fill rows, or every response rejected by the correction) takes no
        # step: AdamW's momentum and weight decay would still move the weights, and the update count would advance.
        has_tokens = jnp.sum(mb_all.loss_mask) > 0
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(has_tokens, new, old),
                                         (new_params, new_opt_state), (params, opt_state))
        out = {"loss": loss, "grad_norm": gnorm, **terms, **grpo.metric_means(metric_sums),
               "skipped_update": (has_tokens & ~new_opt_state.last_finite).astype(F32),
               "empty_minibatch": (~has_tokens).astype(F32)}
        return params, opt_state, out

    def update(self, mb: RolloutBatch) -> dict[str, jax.Array]:
        """One optimizer step on a mini-batch (gradient accumulation over micro-batches inside); a mini-batch
        without a real token leaves parameters, optimizer state and the update count untouched."""
        if mb.num % self.micro:
            raise ValueError(f"mini-batch of {mb.num} responses is not a multiple of rl.micro_batch={self.micro}")
        mb = self.shard_batch(mb)
        with shd.activate(self.mesh, self.rules):
            self.params, self.opt_state, out = self._update(self.params, self.opt_state, mb)
        self.version += 1
        return out

    # ------------------------------------------------------------------------------------------ compile ahead
    def compile_thunks(self, n: int, prompt_len: int, resp_len: int, *, mini_batch: int, behaviour: bool = False,
                       null_key=None) -> list:
        """Thunks that compile the programs a step runs on an n-response rollout of [prompt_len | resp_len] tokens,
        for the arguments it passes them: the log-probs (one program for the learner's, the reference's and a
        stale rollout's behaviour weights: same shapes), the corrections + diagnostics (`behaviour`: a stale
        rollout's; `null_key`: the step's key or its abstract value, or None) and the update of a mini_batch-row
        slice. Run on threads while the rollout generates (config learner.compile_ahead), the step's own
        calls then find them compiled; a call with other arguments (MoE routing replay) compiles as before.
        Each program compiles in the context its call runs in (log-probs and update inside the mesh context,
        prepare outside it): compiled in the other context it is another cache entry (measured: the update
        compiled twice)."""
        s = prompt_len + resp_len
        rows = shd.batch_sharding(self.mesh, 2, self.rules)  # shard_batch's
        ids_a = jax.ShapeDtypeStruct((n, s), jnp.int32, sharding=rows)
        am_a = jax.ShapeDtypeStruct((n, s), jnp.bool_, sharding=rows)
        # prepare's host inputs arrive as uncommitted arrays (jnp.asarray of the rollout's NumPy arrays).
        host = {name: jax.ShapeDtypeStruct(shape, dt) for name, shape, dt in (
            ("input_ids", (n, s), jnp.int32), ("attn_mask", (n, s), jnp.bool_), ("resp_mask", (n, resp_len), F32),
            ("adv", (n,), F32), ("sampler_logp", (n, resp_len), F32))}
        key_a = None if null_key is None else jax.ShapeDtypeStruct(jnp.shape(null_key), null_key.dtype)
        # Abstract state, taken now: the thunks run while updates may donate (delete) the current arrays.
        params_a, opt_a = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t)
                           for t in (self.params, self.opt_state))

        def logprobs():
            return self._logprobs.lower(params_a, ids_a, am_a, resp_len, None).compile()

        def prepare(logp_sharding):
            logp = jax.ShapeDtypeStruct((n, resp_len), F32, sharding=logp_sharding)
            self._prepare.lower(host["input_ids"], host["attn_mask"], host["resp_mask"], host["adv"],
                                host["sampler_logp"], logp, logp, None, logp if behaviour else None,
                                null_key=key_a).compile()

        def logprobs_then_prepare():
            # The log-probs reach prepare laid out as their program's output (known once compiled); prepare is
            # called outside the mesh context, so it compiles outside it.
            prepare(self._in_context(logprobs).output_shardings[0])

        def update():
            self._in_context(lambda: self._update.lower(
                params_a, opt_a, self.abstract_batch(mini_batch, prompt_len, resp_len)).compile())

        return [logprobs_then_prepare, update]

    def _in_context(self, thunk):
        with shd.activate(self.mesh, self.rules):  # per thread: a compiling thread enters it
            return thunk()

    # ------------------------------------------------------------------------------------------ dry-run
    def abstract_batch(self, n: int, prompt_len: int, resp_len: int) -> RolloutBatch:
        """A sharded ShapeDtypeStruct RolloutBatch of n responses of [prompt_len | resp_len] tokens."""
        s = prompt_len + resp_len
        shapes = dict(input_ids=((n, s), jnp.int32), attn_mask=((n, s), jnp.bool_), resp_mask=((n, resp_len), F32),
                      adv=((n,), F32), sampler_logp=((n, resp_len), F32), old_logp=((n, resp_len), F32),
                      ref_logp=((n, resp_len), F32), weights=((n, resp_len), F32), loss_mask=((n, resp_len), F32),
                      anchor_logp=((n, resp_len), F32))
        return RolloutBatch(**{k: jax.ShapeDtypeStruct(shape, dt, sharding=shd.batch_sharding(
            self.mesh, len(shape), self.rules)) for k, (shape, dt) in shapes.items()})

    def lower_update(self, n: int, prompt_len: int, resp_len: int):
        """The update of an n-response mini-batch lowered for the mesh (jax.stages.Lowered; compile() it)."""
        with shd.activate(self.mesh, self.rules):
            return self._update.lower(self.params, self.opt_state, self.abstract_batch(n, prompt_len, resp_len))


def prepare(input_ids, attn_mask, resp_mask, adv, sampler_logp, old_logp, ref_logp, routing=None,
            behaviour_logp=None, *, correction: Correction, triage: TriageConfig, delta_source: str = "total",
            null_key: jax.Array | None = None) -> tuple[RolloutBatch, dict[str, jax.Array], jax.Array]:
    """Apply `correction` and compute the mismatch diagnostics (segmented as `triage` says).

    Synchronous rollout (behaviour_logp None): delta = old_logp - sampler_logp, diagnostics under `mismatch/`.
    Stale rollout (behaviour_logp = the learner at the weights that sampled it): delta splits into precision and
    staleness (`rl.delta.delta_parts`), each with its diagnostics (`mismatch_precision/`, `mismatch_staleness/`,
    the total under `mismatch/`), and the correction acts on the one `delta_source` names.

    With `null_key` each delta's diagnostics add the permutation nulls of rho_asym and tail persistence
    (`diagnostics.NULL_METRICS`; one key per delta, folded from it).

    Returns the batch ready for `Learner.update`, the metrics and the total delta.
    """
    if behaviour_logp is None:
        if delta_source == "staleness":
            raise ValueError("prepare(delta_source='staleness') needs behaviour_logp (a stale rollout)")
        # Behaviour weights = current weights: delta_precision = delta_total, delta_staleness = 0.
        delta = token_delta(old_logp, sampler_logp, resp_mask)
        deltas = {"mismatch": delta}
        acted, anchor = delta, sampler_logp
    else:
        parts = delta_parts(old_logp, behaviour_logp, sampler_logp, resp_mask)
        delta = parts.total
        deltas = {"mismatch": parts.total, "mismatch_precision": parts.precision,
                  "mismatch_staleness": parts.staleness}
        acted = select_delta(parts, delta_source)
        anchor = delta_anchor(delta_source, parts, sampler_logp, behaviour_logp)
    out = corr.apply_correction(correction.name, adv=adv, delta=acted, mask=resp_mask, cfg=correction.cfg)
    batch = RolloutBatch(input_ids=input_ids, attn_mask=attn_mask, resp_mask=resp_mask, adv=adv,
                         sampler_logp=sampler_logp, old_logp=old_logp, ref_logp=ref_logp, weights=out.weights,
                         loss_mask=out.mask.astype(F32), anchor_logp=anchor, routing=routing)
    # b_amp / b_con use the applied weights; for TRIAGE on the delta it acted on they are its alpha, which the fast
    # path recomputes (any other delta of a stale rollout is weighed by the alpha that was applied).
    tcfg = correction.cfg if correction.name == "triage" else triage
    metrics = {}
    for i, (prefix, d) in enumerate(deltas.items()):
        fast = correction.name == "triage" and d is acted
        key = None if null_key is None else jax.random.fold_in(null_key, i)
        diag = diagnostics.mismatch_metrics(adv, d, resp_mask, tcfg, weights=None if fast else out.weights,
                                            null_key=key)
        metrics.update({f"{prefix}/{k}": v for k, v in diag.items()})
    metrics.update({f"correction/{k}": v for k, v in out.metrics.items()})
    return batch, metrics, delta
