"""Tokenizers behind one small interface: a built-in character tokenizer for the tiny configs, HF
`tokenizer.json` files (Qwen3) through the `tokenizers` library with the Qwen3 chat template for prompts, and a
byte-level BPE trained on a task's own corpus (`train_bpe`, the model organism's tokenizer).

Interface: encode(str) -> list[int]; decode(ids) -> str; encode_prompt(user_text) -> list[int] (chat template
applied where the tokenizer has one); vocab_size; pad_id; eos_ids (every stop id); bos_id (or None).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_ids: list[int]
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str: ...

    def format_prompt(self, user_text: str) -> str: ...

    def encode_prompt(self, user_text: str) -> list[int]: ...


# ----------------------------------------------------------------------------------------------- characters

PAD, EOS = "<pad>", "<eos>"
CHAR_SPECIALS = (PAD, EOS)
CHAR_ALPHABET = "\t\n" + "".join(chr(c) for c in range(32, 127))  # printable ASCII


class CharTokenizer:
    """One id per printable-ASCII character (plus tab and newline) after the specials <pad>=0, <eos>=1.

    Characters outside the alphabet are an error in `encode` (the tiny task is pure ASCII); ids outside the
    vocabulary (a model whose embedding is padded past vocab_size) decode to nothing.
    """

    def __init__(self):
        self.specials = CHAR_SPECIALS
        self.alphabet = CHAR_ALPHABET
        self._offset = len(self.specials)
        self._char_to_id = {ch: i + self._offset for i, ch in enumerate(self.alphabet)}
        self.vocab_size = self._offset + len(self.alphabet)
        self.pad_id = self.specials.index(PAD)
        self.eos_ids = [self.specials.index(EOS)]
        self.bos_id = None

    def encode(self, text: str) -> list[int]:
        try:
            return [self._char_to_id[ch] for ch in text]
        except KeyError:
            bad = next(i for i, ch in enumerate(text) if ch not in self._char_to_id)
            raise ValueError(f"CharTokenizer cannot encode {text[bad]!r} at position {bad}: only printable ASCII, "
                             "tab and newline are in its vocabulary") from None

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if self._offset <= i < self.vocab_size:
                out.append(self.alphabet[i - self._offset])
            elif not skip_special and 0 <= i < self._offset:
                out.append(self.specials[i])
        return "".join(out)

    def format_prompt(self, user_text: str) -> str:
        return user_text

    def encode_prompt(self, user_text: str) -> list[int]:
        return self.encode(user_text)


# ----------------------------------------------------------------------------------------------- HF tokenizer.json

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
QWEN3_STOP_TOKENS = (IM_END, ENDOFTEXT)


def qwen3_chat_prompt(user_text: str, *, thinking: bool = True) -> str:
    """Qwen3's chat template for one user turn plus the generation prompt; `thinking=False` adds the empty think
    block Qwen3 uses to switch reasoning off."""
    prompt = f"{IM_START}user\n{user_text}{IM_END}\n{IM_START}assistant\n"
    return prompt if thinking else prompt + "<think>\n\n</think>\n\n"


class HFTokenizer:
    """A `tokenizers.Tokenizer` from tokenizer.json with Qwen3 conventions: chat-templated prompts, stop on both
    <|im_end|> and <|endoftext|>, pad with <|endoftext|>."""

    def __init__(self, path: str | os.PathLike, *, chat_template: bool = True, thinking: bool = True,
                 stop_tokens: Sequence[str] = QWEN3_STOP_TOKENS):
        from tokenizers import Tokenizer as _HFTok

        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path!r}")
        self.path = path
        self._tok = _HFTok.from_file(path)
        self.chat_template = chat_template
        self.thinking = thinking
        if chat_template:
            missing = [t for t in (IM_START, IM_END) if self._tok.token_to_id(t) is None]
            if missing:
                raise ValueError(f"tokenizer {path!r} lacks the chat-template tokens {missing}; "
                                 "pass chat_template=False for a tokenizer without them")
        self.eos_ids = [i for i in (self._tok.token_to_id(t) for t in stop_tokens) if i is not None]
        if not self.eos_ids:
            raise ValueError(f"tokenizer {path!r} has none of the stop tokens {list(stop_tokens)}")
        pad = self._tok.token_to_id(ENDOFTEXT)
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        self.bos_id = None  # Qwen3 uses no BOS token
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def format_prompt(self, user_text: str) -> str:
        return qwen3_chat_prompt(user_text, thinking=self.thinking) if self.chat_template else user_text

    def encode_prompt(self, user_text: str) -> list[int]:
        return self.encode(self.format_prompt(user_text))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


# ----------------------------------------------------------------------------------------------- task BPE

BPE_SPECIALS = (ENDOFTEXT,)  # pad and stop, as in Qwen3; no chat template (the task's prompts are plain text)
BPE_MIN_VOCAB = 256 + len(BPE_SPECIALS) + 1  # the byte alphabet, the specials and at least one merge


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (`tokenizers.Tokenizer`) of at most `vocab_size` ids trained on `texts`. Numbers split
    into single digits first, as Qwen3's pre-tokenizer does, so arithmetic stays digit by digit. Deterministic:
    the same texts give the same tokenizer.json (ties between equally frequent pairs break by the pair itself)."""
    from tokenizers import Tokenizer as _HFTok, decoders, models, pre_tokenizers, trainers

    if not BPE_MIN_VOCAB <= int(vocab_size):
        raise ValueError(f"BPE vocab_size must be >= {BPE_MIN_VOCAB} (256 bytes, the specials {list(BPE_SPECIALS)} "
                         f"and one merge), got {vocab_size}")
    tok = _HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), special_tokens=list(BPE_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    return tok


def task_bpe_tokenizer(texts: Iterable[str], vocab_size: int, path: str | os.PathLike) -> HFTokenizer:
    """`train_bpe` on `texts`, saved as `path` (a tokenizer.json, written beside and renamed) and loaded as an
    HFTokenizer without chat template that pads and stops with <|endoftext|>."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    train_bpe(texts, vocab_size).save(tmp)
    os.replace(tmp, path)
    return HFTokenizer(path, chat_template=False, stop_tokens=BPE_SPECIALS)


def load_tokenizer(spec: str, **kwargs) -> Tokenizer:
    """A tokenizer from its config string: "char", or a path to tokenizer.json (or the folder holding it)."""
    if spec == "bpe":
        raise ValueError("tokenizer 'bpe' is trained on the task's corpus: build it with build.tokenizer(config)")
    if spec == "char":
        if kwargs:
            raise ValueError(f"the char tokenizer takes no options, got {sorted(kwargs)}")
        return CharTokenizer()
    path = os.path.expanduser(spec)
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(path, **kwargs)
    raise FileNotFoundError(f"tokenizer spec {spec!r} is neither 'char' nor a path to tokenizer.json "
                            "(or a folder holding one)")


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists into `ids_bt` int32 [B, T] (T = `length` or the longest) and `lengths_b` int32 [B]."""
    lengths_b = np.asarray([len(s) for s in seqs], dtype=np.int32)
    t = int(lengths_b.max(initial=0)) if length is None else int(length)
    if lengths_b.size and lengths_b.max() > t:
        raise ValueError(f"a sequence of {int(lengths_b.max())} tokens does not fit the padded length {t}")
    ids_bt = np.full((len(seqs), t), pad_id, dtype=np.int32)
    for b, s in enumerate(seqs):
        if len(s):
            ids_bt[b, t - len(s):] = s
    return ids_bt, lengths_b
