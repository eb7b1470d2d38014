"""Tokenizers: built-in characters, and a tokenizer.json with Qwen3's chat template and stop tokens."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from triage_jax.data import CharTokenizer, HFTokenizer, Tokenizer as TokenizerProtocol, left_pad, load_tokenizer
from triage_jax.data.synthetic import SyntheticMathSource
from triage_jax.data.tokenizers import ENDOFTEXT, IM_END, IM_START, qwen3_chat_prompt

SPECIALS = [ENDOFTEXT, IM_START, IM_END]


@pytest.fixture(scope="module")
def qwen_like_json(tmp_path_factory):
    """A small byte-level BPE with Qwen3's special tokens, trained and saved as tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [ex.prompt for ex in SyntheticMathSource(200, seed=0)] + ["Answer: 42", "user", "assistant"]
    tok.train_from_iterator(corpus, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_char_roundtrip_specials_and_unknowns():
    tok = CharTokenizer()
    assert isinstance(tok, TokenizerProtocol)
    assert (tok.pad_id, tok.eos_ids, tok.bos_id, tok.vocab_size) == (0, [1], None, 99)
    text = "Q: (12-5)*3=? A: 12-5=7, 7*3=21\nAnswer: 21\t~"
    ids = tok.encode(text)
    assert len(ids) == len(text) and min(ids) >= 2 and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode([tok.pad_id, *ids[:3], tok.eos_ids[0], 500]) == text[:3]  # specials, out-of-range dropped
    assert tok.decode([*ids[:2], tok.eos_ids[0]], skip_special=False) == text[:2] + "<eos>"
    assert tok.encode_prompt("Q: 1+1=? A:") == tok.encode("Q: 1+1=? A:")
    with pytest.raises(ValueError, match=r"'é' at position 3"):
        tok.encode("caf\u00e9")


def test_hf_tokenizer_chat_template_and_stop_ids(qwen_like_json):
    tok = HFTokenizer(qwen_like_json)
    assert isinstance(tok, TokenizerProtocol)
    im_start, im_end, eot = (tok.token_to_id(t) for t in (IM_START, IM_END, ENDOFTEXT))
    assert tok.eos_ids == [im_end, eot] and tok.pad_id == eot and tok.bos_id is None
    assert tok.vocab_size == 300

    user = "What is 3+4?"
    assert tok.format_prompt(user) == f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_prompt(user)
    assert ids[0] == im_start and ids.count(im_start) == 2 and ids.count(im_end) == 1  # specials are single ids
    assert tok.decode(ids, skip_special=False) == tok.format_prompt(user)
    assert tok.decode(ids) == f"user\n{user}\nassistant\n"
    response = "3+4=7\nAnswer: 7"
    assert tok.decode(tok.encode(response) + [im_end, eot]) == response


def test_hf_tokenizer_options_and_errors(qwen_like_json, tmp_path):
    no_think = HFTokenizer(qwen_like_json, thinking=False)
    assert no_think.format_prompt("x").endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert HFTokenizer(qwen_like_json, chat_template=False).format_prompt("x") == "x"
    assert qwen3_chat_prompt("x") == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"

    plain = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    plain.save(str(tmp_path / "plain.json"))
    with pytest.raises(ValueError, match="chat-template tokens"):
        HFTokenizer(tmp_path / "plain.json")
    with pytest.raises(ValueError, match="stop tokens"):
        HFTokenizer(tmp_path / "plain.json", chat_template=False)


def test_load_tokenizer_by_spec(qwen_like_json, tmp_path):
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    assert load_tokenizer(str(qwen_like_json)).vocab_size == 300
    assert load_tokenizer(str(qwen_like_json.parent)).path == str(qwen_like_json)  # a checkpoint folder works too
    with pytest.raises(FileNotFoundError, match="neither 'char' nor a path"):
        load_tokenizer(str(tmp_path / "nowhere"))


def test_left_pad():
    ids_bt, lengths_b = left_pad([[5, 6, 7], [8]], pad_id=0)
    np.testing.assert_array_equal(ids_bt, [[5, 6, 7], [0, 0, 8]])
    np.testing.assert_array_equal(lengths_b, [3, 1])
    assert ids_bt.dtype == np.int32 and left_pad([[1]], 0, length=4)[0].tolist() == [[0, 0, 0, 1]]
    with pytest.raises(ValueError, match="does not fit"):
        left_pad([[1, 2, 3]], 0, length=2)


# ----------------------------------------------------------------------------------------------- task BPE


def _long_corpus(n=600):
    src = SyntheticMathSource(n, seed=0, levels=(5, 6), template="short", style="words")
    return [f"{p}\n{s}" for p, s in (src.sft_pair(i) for i in range(n))]


def test_task_bpe_is_deterministic_keeps_digits_single_and_roundtrips():
    from triage_jax.data.tokenizers import train_bpe

    corpus = _long_corpus()
    a, b = train_bpe(corpus, 600), train_bpe(list(corpus), 600)
    assert a.to_str() == b.to_str()  # same texts, same tokenizer.json: every seed of a config shares it
    assert 300 < a.get_vocab_size() <= 600
    for text in corpus[:50]:
        enc = a.encode(text)
        assert a.decode(enc.ids) == text
        assert all(not any(ch.isdigit() for ch in t) or len(t) == 1 for t in enc.tokens)  # 12 -> "1", "2"
    with pytest.raises(ValueError, match="vocab_size must be >= 258"):
        train_bpe(corpus, 257)


def test_build_trains_the_task_bpe_into_the_run_dir(tmp_path):
    from triage_jax import build
    from triage_jax.config import base_config

    c = base_config()
    c.run_dir = str(tmp_path / "run")
    c.tokenizer, c.data.levels, c.data.style = "bpe", (5, 6), "words"
    c.bpe.vocab_size, c.bpe.corpus_size = 700, 800
    tok = build.tokenizer(c)
    assert tok.vocab_size <= 700 and tok.eos_ids == [tok.pad_id] == [tok.token_to_id(ENDOFTEXT)]
    saved = load_tokenizer(str(tmp_path / "run" / "tokenizer.json"), chat_template=False, stop_tokens=(ENDOFTEXT,))
    prompt, solution = build.source(c).sft_pair(3)
    assert saved.encode(prompt + solution) == tok.encode(prompt + solution)
    assert tok.encode_prompt(prompt) == tok.encode(prompt)  # plain text: no chat template
    assert tok.decode(tok.encode(solution) + tok.eos_ids) == solution  # the stop token decodes to nothing
    with pytest.raises(ValueError, match="build.tokenizer"):
        load_tokenizer("bpe")
