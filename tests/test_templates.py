"""Tests for the chat templates, `<image>` expansion and id-level prompts in tinyvila/tokenizer.py.

Run: python -m pytest tests/test_templates.py -q. Golden strings are written from VILA's
`llava/conversation.py` (VILA1.5 era); id-level prompts are checked against VILA's
`tokenizer_image_token` on the whole `get_prompt()` string, with byte-level, trained BPE and
trained sentencepiece tokenizers.
"""

import json

import pytest

from tinyvila.tokenizer import (
    IMAGE_TOKEN, LLAMA3_PATTERN, QWEN2_PATTERN, TEMPLATES, BPETokenizer, byte_tokenizer_json, conversation_ids,
    expand_images, get_template, load_tokenizer, stop_ids, tokenizer_image_token, turn_ids,
)

LLAMA3_GOLDEN = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful language and vision "
    "assistant. You are able to understand the visual content that the user provides, and assist the user with "
    "a variety of tasks using natural language.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n<image>\n"
    "What is this?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
)
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                 "helpful, detailed, and polite answers to the user's questions.")


def byte_tok(template):
    return BPETokenizer(byte_tokenizer_json(list(template.special_tokens), bos=template.bos))


def test_golden_single_turn():
    q = expand_images("What is this?", 1)
    assert TEMPLATES["llama_3"].render([(q, None)]) == LLAMA3_GOLDEN
    assert TEMPLATES["vicuna_v1"].render([(q, None)]) == VICUNA_SYSTEM + " USER: <image>\nWhat is this? ASSISTANT:"
    assert TEMPLATES["hermes-2"].render([(q, None)]) == (
        "<|im_start|>system\nAnswer the questions.<|im_end|><|im_start|>user\n<image>\nWhat is this?<|im_end|>"
        "<|im_start|>assistant\n")


def test_golden_multi_turn():
    turns = [("Q1", "A1"), ("Q2", None)]
    assert TEMPLATES["vicuna_v1"].render(turns) == VICUNA_SYSTEM + " USER: Q1 ASSISTANT: A1</s>USER: Q2 ASSISTANT:"
    u, a = TEMPLATES["llama_3"].roles
    assert TEMPLATES["llama_3"].render(turns).endswith(f"{u}Q1<|eot_id|>{a}A1<|eot_id|>{u}Q2<|eot_id|>{a}")
    # the last filled message of a finished conversation takes sep2
    assert TEMPLATES["llama_3"].render([("Q1", "A1")]).endswith(f"{a}A1<|end_of_text|>")
    assert TEMPLATES["hermes-2"].render(turns).endswith(
        "<|im_start|>user\nQ1<|im_end|><|im_start|>assistant\nA1<|im_end|><|im_start|>user\nQ2<|im_end|>"
        "<|im_start|>assistant\n")
    assert TEMPLATES["hermes-2"].render(turns, system="S").startswith("S<|im_end|><|im_start|>user\n")


def test_template_metadata():
    assert TEMPLATES["llama_3"].stop_strings == ("<|eot_id|>", "<|end_of_text|>")
    assert (TEMPLATES["vicuna_v1"].bos, TEMPLATES["hermes-2"].bos) == ("<s>", None)
    tok = byte_tok(TEMPLATES["llama_3"])
    assert stop_ids(tok, TEMPLATES["llama_3"]) == [260, 257]
    with pytest.raises(ValueError, match="vicuna_v1"):
        get_template("vicuna")


def test_expand_images():
    assert expand_images("hi", 2) == "<image>\n<image>\nhi"
    assert expand_images("hi", 0) == "hi"
    assert expand_images("a <image> b <image>", 2) == "a <image> b <image>"
    with pytest.raises(ValueError, match="2 images"):
        expand_images("a <image> b", 2)


def test_image_sentinels_and_doubled_bos():
    tpl = TEMPLATES["llama_3"]
    tok = byte_tok(tpl)
    bos = tok.bos_id
    ids = tokenizer_image_token(tok, tpl.render([(expand_images("hi", 3), None)]))
    assert ids[:2] == [bos, bos] and ids.count(bos) == 2  # tokenizer BOS + the template's literal one
    pos = [i for i, t in enumerate(ids) if t == IMAGE_TOKEN]
    assert len(pos) == 3 and pos[1] - pos[0] == 2 and ids[pos[0] + 1] == ord("\n")
    assert ids == turn_ids(tok, tpl, "hi", 3, first=True)
    single = tokenizer_image_token(tok, "<image>")
    assert single == [bos, IMAGE_TOKEN]


def test_no_bos_template_keeps_first_token():
    tpl = TEMPLATES["hermes-2"]
    tok = byte_tok(tpl)
    ids = turn_ids(tok, tpl, "<image> what", 1, first=True)
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids.count(IMAGE_TOKEN) == 1
    assert ids == tokenizer_image_token(tok, tpl.render([("<image> what", None)]))


# ---------------------------------------------------------------------------------------------
# Multi-turn ids: segments == whole-string tokenisation, cache grown turn by turn == whole


CONVERSATION = [("Describe the picture.", 1, "A cat sits on a mat."), ("And here? 日本", 2, "Two dogs, 3 balls."),
                ("<image> Compare: <image>", 2, "The first is darker."), ("Thanks!", 0, None)]


def answer_ids(tok, tpl, text):
    """Ids an answer has inside the whole prompt: as text after an assistant header (vicuna
    writes "ASSISTANT: " + answer), cut out of a longer encoding so no prefix space is added."""
    shown = " " + text if tpl.style == "two" else text
    head = tok.encode("X", add_special_tokens=False)
    full = tok.encode("X" + shown, add_special_tokens=False)
    assert full[: len(head)] == head
    return full[len(head):]


def check_conversation(tok, tpl):
    turns = [(u, n, answer_ids(tok, tpl, a) if a else None) for u, n, a in CONVERSATION]
    whole = tokenizer_image_token(tok, tpl.render([(expand_images(u, n), a) for u, n, a in CONVERSATION]))
    assert conversation_ids(tok, tpl, turns) == whole
    assert whole.count(IMAGE_TOKEN) == 5
    cache = []
    for k, (user, n, answer) in enumerate(turns):
        prev = turns[k - 1][2] if k else None
        cache += turn_ids(tok, tpl, user, n, first=k == 0, prev_answer_ids=prev)
        assert cache == conversation_ids(tok, tpl, turns[:k] + [(user, n, None)])
        cache += answer or []


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_conversation_byte_tokenizer(name):
    check_conversation(byte_tok(TEMPLATES[name]), TEMPLATES[name])


def test_answer_ending_with_stop_token_is_not_doubled():
    tpl = TEMPLATES["llama_3"]
    tok = byte_tok(tpl)
    eot = tok.token_to_id("<|eot_id|>")
    a = answer_ids(tok, tpl, "ok")
    with_stop = conversation_ids(tok, tpl, [("q", 0, a + [eot]), ("r", 0, None)])
    without = conversation_ids(tok, tpl, [("q", 0, a), ("r", 0, None)])
    assert with_stop == without and with_stop.count(eot) == 4  # system, q, answer, r
    assert turn_ids(tok, tpl, "r", 0, first=False, prev_answer_ids=a + [eot])[0] != eot
    assert turn_ids(tok, tpl, "r", 0, first=False, prev_answer_ids=a)[0] == eot
    with pytest.raises(ValueError, match="no answer"):
        conversation_ids(tok, tpl, [("q", 0, None), ("r", 0, None)])


def _trained_bpe(tmp_path, split, specials, bos):
    tk = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    import pydoc_data.topics
    tok = tk.Tokenizer(models.BPE(ignore_merges=bos is not None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(tk.Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    text = "\n".join(list(pydoc_data.topics.topics.values())[:20])[:30000] + "\n" + "\n".join(c[0] for c in CONVERSATION)
    tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=list(specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(tmp_path / "tokenizer.json"))
    return load_tokenizer(tmp_path)


def test_conversation_llama3_bpe(tmp_path):
    tpl = TEMPLATES["llama_3"]
    check_conversation(_trained_bpe(tmp_path, LLAMA3_PATTERN, tpl.special_tokens, tpl.bos), tpl)


def test_conversation_hermes_qwen2_bpe(tmp_path):
    tpl = TEMPLATES["hermes-2"]
    check_conversation(_trained_bpe(tmp_path, QWEN2_PATTERN, ("<|endoftext|>",) + tpl.special_tokens, None), tpl)


@pytest.mark.parametrize("legacy", [False, True])
def test_conversation_vicuna_sentencepiece(tmp_path, legacy):
    spm = pytest.importorskip("sentencepiece")
    import pydoc_data.topics
    text = "\n".join(list(pydoc_data.topics.topics.values())[:20])[:30000]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_prefix=str(tmp_path / "tokenizer"), vocab_size=500,
        model_type="bpe", byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        unk_id=0, bos_id=1, eos_id=2, character_coverage=1.0, minloglevel=2)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    check_conversation(load_tokenizer(tmp_path, legacy=legacy), TEMPLATES["vicuna_v1"])
