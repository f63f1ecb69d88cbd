"""Fine-tuning data: chat templates (found, compiled, rendered as ``transformers`` renders
them), the ids of a conversation (equal to ``apply_chat_template``'s), labels on the answers
only, packing into windows of whole samples with their own document numbers, exact resume, and
one-line refusals of bad rows."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from torchtitan.components.chat_template import (
    ChatTemplate,
    find_template,
    template_source,
)
from torchtitan.components.data_sources import check_format, open_dataset
from torchtitan.components.dataloader import build_dataloader
from torchtitan.components.hf_tokenizer import HuggingFaceTokenizer
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.sft_data import SFTDataset, load_chat_template, sft_datasets
from torchtitan.components.tokenizer import DEFAULT_TOKENIZER_PATH, build_tokenizer
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.validation import validate

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

REPO = Path(__file__).resolve().parents[3]
HF_TOKENIZER = REPO / "tests/assets/tokenizer_hf"
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What does os.getcwd do?"},
    {"role": "assistant", "content": "Return the current working directory."},
    {"role": "user", "content": "Repeat these words: alpha beta"},
    {"role": "assistant", "content": "alpha beta"},
]
# A template that shows only the last assistant answer in full (as reasoning templates strip
# earlier turns' thoughts): earlier answers cannot be located in the whole conversation.
LAST_ONLY = (
    "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[A: ...]"
    "{% else %}[{{ m.role }}: {{ m.content }}]{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def template(tokenizer):
    return load_chat_template(tokenizer, tokenizer_path=str(DEFAULT_TOKENIZER_PATH), override=None)


def _rows(tmp_path: Path, rows: list[dict], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dataset(path: Path, tokenizer, template=None, **kwargs) -> SFTDataset:
    data, _ = open_dataset("files", str(path), data_format=kwargs.get("data_format", "chat"))
    args = dict(seq_len=256, data_format="chat", template=template, infinite=False)
    return SFTDataset(data, name="files", tokenizer=tokenizer, **(args | kwargs))


def _trained_text(tokenizer, labels: torch.Tensor) -> str:
    return tokenizer.decode([t for t in labels.tolist() if t != IGNORE_INDEX])


# ---- templates ---------------------------------------------------------------------------------


def test_ids_equal_transformers_apply_chat_template(tokenizer, template):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(HF_TOKENIZER))
    want = hf.apply_chat_template(CONVERSATION, tokenize=True)
    want = want["input_ids"] if not isinstance(want, list) else want
    text, _, _ = template.assistant_spans(CONVERSATION)
    assert tokenizer.encode_template(text)[0] == want
    # The tokenizer.json path gives the same ids and the same token starts.
    hf_ours = HuggingFaceTokenizer(HF_TOKENIZER / "tokenizer.json")
    assert hf_ours.encode_template(text) == tokenizer.encode_template(text)
    # And plain encode still keeps special-token strings as text (data cannot inject them).
    assert hf_ours._model.encode_special_tokens


def test_labels_are_the_assistant_turns_only(tokenizer, template, tmp_path):
    data = _dataset(_rows(tmp_path, [{"messages": CONVERSATION}]), tokenizer, template, pack=False)
    ((inputs, labels),) = list(data)
    assert _trained_text(tokenizer, labels) == (
        "Return the current working directory.<|eot_id|>alpha beta<|eot_id|>"
    )
    text, _, _ = template.assistant_spans(CONVERSATION)
    ids = tokenizer.encode_template(text)[0]
    assert inputs["input"][: len(ids) - 1].tolist() == ids[:-1]
    assert inputs["input"][len(ids) - 1 :].eq(tokenizer.pad_id).all()
    assert "document_ids" not in inputs  # one sample per window: plain causal attention
    # Each label is the next input token where it is trained.
    kept = labels[: len(ids) - 1] != IGNORE_INDEX
    assert labels[: len(ids) - 1][kept].tolist() == torch.tensor(ids[1:])[kept].tolist()


def test_train_on_prompt_labels_every_token(tokenizer, template, tmp_path):
    path = _rows(tmp_path, [{"messages": CONVERSATION}])
    ((inputs, labels),) = list(
        _dataset(path, tokenizer, template, pack=False, train_on_prompt=True)
    )
    n = int((labels != IGNORE_INDEX).sum())
    assert labels[: n - 1].tolist() == inputs["input"][1:n].tolist()
    assert tokenizer.token_name(int(labels[n - 1])) == "<|eot_id|>"
    assert (labels[n:] == IGNORE_INDEX).all()


def test_prompt_completion_trains_on_the_completion_and_eos(tokenizer, tmp_path):
    path = _rows(tmp_path, [{"prompt": "Question: 2 + 2?", "completion": " Four."}])
    data = _dataset(path, tokenizer, data_format="prompt_completion", pack=False)
    ((inputs, labels),) = list(data)
    assert _trained_text(tokenizer, labels) == " Four.<|end_of_text|>"
    prompt = tokenizer.encode("Question: 2 + 2?", add_bos=True)
    assert inputs["input"][: len(prompt)].tolist() == prompt


def test_unlocated_turns_are_not_trained_and_counted(tokenizer, tmp_path, caplog):
    lone = ChatTemplate(LAST_ONLY, where="test")
    path = _rows(tmp_path, [{"messages": CONVERSATION}])
    ((_, labels),) = list(_dataset(path, tokenizer, lone, pack=False))
    assert _trained_text(tokenizer, labels) == " alpha beta]"  # (the space is alpha's token)
    assert "1 assistant turns not trained on" in caplog.text


# ---- packing -----------------------------------------------------------------------------------


def _qa(i: int, words: int = 3) -> dict:
    answer = " ".join(["word"] * words)
    return {
        "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": answer}]
    }


def test_packed_windows_hold_whole_samples_each_its_own_document(tokenizer, template, tmp_path):
    rows = [_qa(i, words=1 + i % 5) for i in range(12)]
    windows = list(_dataset(_rows(tmp_path, rows), tokenizer, template, seq_len=64))
    alone = [list(_dataset(_rows(tmp_path, [r], f"{i}.jsonl"), tokenizer, template, pack=False))[0]
             for i, r in enumerate(rows)]  # fmt: skip
    samples = []
    for inputs, labels in windows:
        docs = inputs["document_ids"]
        assert docs.dtype == torch.int32 and docs.shape == labels.shape == (64,)
        assert (docs[1:] >= docs[:-1]).all()
        last = int(docs[-1])
        padding = docs == last
        if (labels[padding] == IGNORE_INDEX).all() and (
            inputs["input"][padding] == tokenizer.pad_id
        ).all():
            pieces = range(last)  # the last document number is the padding's
        else:
            pieces = range(last + 1)  # a window filled exactly
        for d in pieces:
            where = docs == d
            samples.append((inputs["input"][where].tolist(), labels[where].tolist()))
    assert len(samples) == len(rows)  # in order, none split, none lost
    for (tokens, labels), (one_inputs, one_labels) in zip(samples, alone, strict=True):
        n = len(tokens)
        assert tokens == one_inputs["input"][:n].tolist()
        assert labels == one_labels[:n].tolist()
        assert (one_labels[n:] == IGNORE_INDEX).all()


def test_too_long_and_untrained_samples_are_left_out_and_reported(
    tokenizer, template, tmp_path, caplog
):
    rows = [
        _qa(0),
        _qa(1, words=200),
        {"messages": [{"role": "user", "content": "no answer"}]},
        _qa(2),
    ]
    windows = list(_dataset(_rows(tmp_path, rows), tokenizer, template, seq_len=64))
    trained = "".join(_trained_text(tokenizer, labels) for _, labels in windows)
    assert trained == "word word word<|eot_id|>" * 2
    assert "1 longer than --training.seq_len 64 left out" in caplog.text
    assert "1 with no answer tokens to train on left out" in caplog.text


def test_a_pass_where_nothing_fits_is_refused(tokenizer, template, tmp_path):
    path = _rows(tmp_path, [_qa(0, words=200), _qa(1, words=300)])
    with pytest.raises(ConfigError, match="none of the 2 samples .* 2 longer than"):
        list(_dataset(path, tokenizer, template, seq_len=64))


def test_resume_mid_window_gives_the_same_windows(tokenizer, template, tmp_path):
    path = _rows(tmp_path, [_qa(i, words=1 + i % 7) for i in range(40)])

    def loader():
        make = sft_datasets("chat", template=template, train_on_prompt=False, pack=True)
        return build_dataloader(
            dataset="files", dataset_path=str(path), tokenizer=tokenizer, seq_len=48,
            local_batch_size=2, dp_rank=0, dp_world_size=1, data_format="chat", infinite=False,
            make_dataset=make,
        )  # fmt: skip

    whole = list(loader())
    first = loader()
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(whole) - 3
    for (got_in, got_labels), (want_in, want_labels) in zip(rest, whole[3:], strict=True):
        assert got_in.keys() == want_in.keys() == {"input", "document_ids"}
        for key in got_in:
            assert torch.equal(got_in[key], want_in[key])
        assert torch.equal(got_labels, want_labels)


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": "hi"}, "has str 'messages', not a non-empty list"),
        ({"messages": [{"role": "user"}]}, "message 0 whose 'content' is not text"),
        ({"messages": [{"content": "x"}]}, "message 0 without a 'role'"),
    ],
)
def test_bad_rows_are_named(tokenizer, template, tmp_path, row, message):
    path = _rows(tmp_path, [_qa(0), row])
    with pytest.raises(ConfigError, match=message):
        list(_dataset(path, tokenizer, template))


def test_a_template_refusing_a_row_names_it(tokenizer, tmp_path):
    strict = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system "
        "messages') }}{% endif %}{{ m.content }}{% endfor %}",
        where="strict.jinja",
    )
    path = _rows(tmp_path, [{"messages": CONVERSATION}])
    with pytest.raises(ConfigError, match="strict.jinja cannot render a row .*no system messages"):
        list(_dataset(path, tokenizer, strict))


def test_fields_and_formats_are_checked_when_opening(tmp_path):
    chat = _rows(tmp_path, [_qa(0)])
    with pytest.raises(ConfigError, match="no 'text'.*--training.data_format chat"):
        open_dataset("files", str(chat))
    text = _rows(tmp_path, [{"text": "hello"}], "text.jsonl")
    with pytest.raises(ConfigError, match="no 'messages'.*--training.data_format text"):
        open_dataset("files", str(text), data_format="chat")
    with pytest.raises(ConfigError, match="chat_demo holds chat rows.*--training.data_format chat"):
        open_dataset("chat_demo", None)
    data, _ = open_dataset("chat_demo", None, data_format="chat")
    assert data[0]["messages"][0]["role"] in ("system", "user")


def test_templates_are_found_where_transformers_looks(tmp_path):
    assert template_source(DEFAULT_TOKENIZER_PATH, None)[1].endswith("chat_template.jinja")
    folder = tmp_path / "model"
    (folder / "original").mkdir(parents=True)
    assert template_source(folder / "original", None) is None
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert template_source(folder / "original", None)[0] == "D"  # HF Llama layout
    (folder / "chat_template.jinja").write_text("J")
    assert template_source(folder, None)[0] == "J"  # the standalone file first
    assert template_source(folder, str(folder / "tokenizer_config.json"))[0] == "D"
    with pytest.raises(ConfigError, match="no such file"):
        template_source(folder, str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="has none .*--training.chat_template FILE"):
        find_template(str(tmp_path), None)
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match=r"bad.jinja is not valid Jinja \(line 1\)"):
        find_template(str(tmp_path), str(tmp_path / "bad.jinja"))


def test_a_prompt_asks_for_an_answer_and_knows_where_it_ends(tokenizer, template):
    ids, end = template.prompt(tokenizer, "hello")
    assert tokenizer.decode(ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tokenizer.token_name(end) == "<|eot_id|>"


def _windows_equal(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (got_in, got_labels), (want_in, want_labels) in zip(got, want, strict=True):
        assert got_in.keys() == want_in.keys()
        assert all(torch.equal(got_in[k], want_in[k]) for k in got_in)
        assert torch.equal(got_labels, want_labels)


def test_resuming_at_any_window_twice_in_a_row_loses_nothing(tokenizer, template, tmp_path):
    """A sample exactly one window long after a partly filled window completes two windows at
    once: states taken between them, and again right after a resumed state's first window,
    resume to the same windows."""
    exact = _qa(99, words=9)
    probe = _dataset(_rows(tmp_path, [exact], "probe.jsonl"), tokenizer, template, pack=False)
    seq_len = len(probe._sample(exact)[0])
    rows = [_qa(0), exact, _qa(1), _qa(2, words=5), exact, _qa(3)]
    path = _rows(tmp_path, rows)

    def fresh() -> SFTDataset:
        return _dataset(path, tokenizer, template, seq_len=seq_len)

    whole = list(fresh())
    assert len(whole) == 6
    data, it, states = fresh(), None, []
    it = iter(data)
    for _ in whole:
        next(it)
        states.append(copy.deepcopy(data.state_dict()))
    for k, state in enumerate(states[:-1]):
        once = fresh()
        once.load_state_dict(copy.deepcopy(state))
        first = next(iter(once))
        twice = fresh()
        twice.load_state_dict(copy.deepcopy(once.state_dict()))
        _windows_equal([first, *twice], whole[k + 1 :])


def test_an_answer_starting_with_a_multibyte_character_trains_from_its_first_byte(
    tokenizer, template, tmp_path
):
    rows = [
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "日本 is 🙂"},
            ]
        }
    ]
    hf = HuggingFaceTokenizer(HF_TOKENIZER / "tokenizer.json")
    for tok in (tokenizer, hf):
        ((_, labels),) = list(_dataset(_rows(tmp_path, rows), tok, template, pack=False))
        assert _trained_text(tok, labels) == "日本 is 🙂<|eot_id|>"


def test_templates_see_what_transformers_passes_them():
    seen = ChatTemplate(
        "{% if tools is not none %}T{% endif %}{% if documents is not none %}D{% endif %}"
        "{% if bos_token is defined %}B{% endif %}{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}"
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
        where="t",
    )
    assert seen.render([{"role": "user", "content": "x"}], add_generation_prompt=False) == (
        '{"a": 2, "b": 1}x'
    )


def test_a_tokenizer_without_bos_gives_templates_none(tmp_path):
    """Qwen's vocabulary has no bos (its documents are framed by eos): templates see no
    bos_token, as in transformers, not the eos standing in for it."""

    class NoBos:
        bos_id = eos_id = 7
        has_bos = False

        def token_name(self, token_id: int) -> str:
            return "<|endoftext|>"

    (tmp_path / "t.jinja").write_text("{{ bos_token is defined }} {{ eos_token }}")
    template = load_chat_template(
        NoBos(), tokenizer_path=str(tmp_path), override=str(tmp_path / "t.jinja")
    )
    assert template.render([], add_generation_prompt=False) == "False <|endoftext|>"


def test_turns_a_template_cannot_render_alone_are_unlocated_and_thinking_prompts_located():
    reads_first = ChatTemplate(
        "{{ messages[0].role }}|{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}",
        where="t",
    )
    messages = [
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a2"},
    ]
    text, spans, unlocated = reads_first.assistant_spans(messages)
    assert unlocated == 1 and [text[a:b] for a, b in spans] == ["a2"]
    # A generation prompt that opens a thought the stored answer does not repeat.
    thinking = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}<end>{% endfor %}"
        "{% if add_generation_prompt %}<assistant><think>{% endif %}",
        where="t",
    )
    text, spans, unlocated = thinking.assistant_spans(messages[1:])
    assert unlocated == 0 and [text[a:b] for a, b in spans] == ["a2<end>"]


def test_the_end_of_turn_token_is_not_a_space(tokenizer):
    spaced = ChatTemplate(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }} {{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}",
        where="t",
        special_tokens={"eos_token": "<|end_of_text|>"},
    )
    assert spaced.prompt(tokenizer, "hi")[1] == tokenizer.eos_id


def test_resuming_other_windows_or_formats_is_refused(tokenizer, template, tmp_path):
    path = _rows(tmp_path, [_qa(i) for i in range(6)])
    packed = _dataset(path, tokenizer, template, seq_len=64, infinite=True)
    next(iter(packed))
    state = packed.state_dict()
    for other, names in (
        (_dataset(path, tokenizer, template, seq_len=32), "--training.seq_len 64"),
        (
            _dataset(path, tokenizer, template, seq_len=64, pack=False),
            ".* and --model.attn_mask block_causal, this run has .* causal",
        ),
    ):
        with pytest.raises(ConfigError, match=f"cut for {names}.*exclude_from_loading dataloader"):
            other.load_state_dict(copy.deepcopy(state))
    text, _ = open_dataset("python_docs", None)
    from torchtitan.components.dataloader import TextDataset

    reader = TextDataset(text, name="python_docs", tokenizer=tokenizer, seq_len=64)
    with pytest.raises(
        ConfigError, match="saved reading --training.data_format chat, this run reads text"
    ):
        reader.load_state_dict(state)
    with pytest.raises(
        ConfigError, match="saved reading --training.data_format text, this run reads chat"
    ):
        packed.load_state_dict(reader.state_dict())


def test_a_validation_dataset_of_another_format_names_the_validation_flag():
    with pytest.raises(
        ConfigError,
        match="--validation.dataset python_docs_validation holds text rows.*pass a "
        r"--validation.dataset of chat rows \(e.g. chat_demo_validation\)",
    ):
        check_format("python_docs_validation", "chat", flag="--validation")


def test_added_tokens_keep_their_whitespace_rules(tmp_path):
    """An added (not special) token that eats the spaces after it (``rstrip``) still does
    when our tokenizer re-marks it special to keep it out of plain text."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer

    raw = Tokenizer.from_file(str(HF_TOKENIZER / "tokenizer.json"))
    raw.add_tokens([AddedToken("<|turn|>", special=False, rstrip=True, normalized=False)])
    raw.save(str(tmp_path / "tokenizer.json"))
    config = (HF_TOKENIZER / "tokenizer_config.json").read_text()
    (tmp_path / "tokenizer_config.json").write_text(config)
    source = "{% for m in messages %}<|turn|>  {{ m.role }}: {{ m.content }}\n{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(source)
    text = ChatTemplate(source, where="t").render(CONVERSATION, add_generation_prompt=False)
    want = transformers.AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        CONVERSATION, tokenize=True
    )
    want = want if isinstance(want, list) else want["input_ids"]
    ours = HuggingFaceTokenizer(tmp_path / "tokenizer.json")
    assert ours.encode_template(text)[0] == want
    assert ours.encode("<|turn|>  x") != ours.encode_template("<|turn|>  x")[0]  # text stays text


def test_a_template_crosses_to_spawned_workers(template):
    import pickle

    copy_ = pickle.loads(pickle.dumps(template))
    assert copy_.where == template.where
    assert copy_.render(CONVERSATION, add_generation_prompt=True) == template.render(
        CONVERSATION, add_generation_prompt=True
    )


def test_workers_states_are_checked_before_any_worker_starts(tokenizer, template, tmp_path):
    """With dataloader workers each loads its own state at its first batch: a state for other
    windows is refused by the training process when it loads the checkpoint, in one line."""
    path = _rows(tmp_path, [_qa(i) for i in range(12)])

    def loader(seq_len: int):
        make = sft_datasets("chat", template=template, train_on_prompt=False, pack=True)
        return build_dataloader(
            dataset="files", dataset_path=str(path), tokenizer=tokenizer, seq_len=seq_len,
            local_batch_size=1, dp_rank=0, dp_world_size=1, data_format="chat",
            make_dataset=make, num_workers=2,
        )  # fmt: skip

    first = loader(64)
    it = iter(first)
    next(it)
    state = first.state_dict()
    del it
    with pytest.raises(ConfigError, match="cut for --training.seq_len 64"):
        loader(48).load_state_dict(state)


# ---- first-fit packing (--training.packing_bins) -------------------------------------------


def _samples_of(windows, tokenizer) -> list[list[int]]:
    """Each window's samples (their input tokens), padding left out."""
    out = []
    for inputs, labels in windows:
        docs = inputs["document_ids"]
        for d in range(int(docs[-1]) + 1):
            where = docs == d
            if (labels[where] == IGNORE_INDEX).all() and (
                inputs["input"][where] == tokenizer.pad_id
            ).all():
                continue  # the padding's
            out.append(inputs["input"][where].tolist())
    return out


def test_first_fit_packs_every_sample_once_into_fewer_windows(tokenizer, template, tmp_path):
    rows = [_qa(i, words=1 + (7 * i) % 23) for i in range(60)]
    path = _rows(tmp_path, rows)
    in_order = list(_dataset(path, tokenizer, template, seq_len=96))
    first_fit = list(_dataset(path, tokenizer, template, seq_len=96, packing_bins=8))
    assert len(first_fit) < len(in_order)
    got, want = _samples_of(first_fit, tokenizer), _samples_of(in_order, tokenizer)
    assert sorted(got) == sorted(want) and got != want  # the same samples, reordered
    assert len(want) == len(rows)


def test_first_fit_resumes_at_any_window(tokenizer, template, tmp_path):
    rows = [_qa(i, words=1 + (7 * i) % 23) for i in range(40)]
    path = _rows(tmp_path, rows)

    def fresh(bins: int = 6) -> SFTDataset:
        return _dataset(path, tokenizer, template, seq_len=96, packing_bins=bins)

    whole = list(fresh())
    data = fresh()
    it = iter(data)
    for k in range(len(whole) - 1):
        next(it)
        resumed = fresh()
        resumed.load_state_dict(copy.deepcopy(data.state_dict()))
        _windows_equal(list(resumed), whole[k + 1 :])
    # Resumed with fewer bins: the fullest open windows leave first; no sample is lost.
    data = fresh()
    it = iter(data)
    before = [next(it) for _ in range(3)]
    fewer = fresh(bins=2)
    fewer.load_state_dict(copy.deepcopy(data.state_dict()))
    assert sorted(_samples_of(before + list(fewer), tokenizer)) == sorted(
        _samples_of(whole, tokenizer)
    )


def test_a_state_from_before_first_fit_resumes(tokenizer, template, tmp_path):
    rows = [_qa(i, words=1 + i % 5) for i in range(12)]
    path = _rows(tmp_path, rows)
    whole = list(_dataset(path, tokenizer, template, seq_len=64))
    data = _dataset(path, tokenizer, template, seq_len=64)
    it = iter(data)
    next(it)
    state = copy.deepcopy(data.state_dict())
    (window,) = state.pop("open")  # the one window being filled, as it was saved then
    state["pending"] = window
    resumed = _dataset(path, tokenizer, template, seq_len=64)
    resumed.load_state_dict(state)
    _windows_equal(list(resumed), whole[1:])


def test_packing_bins_without_packing_is_refused():
    config = JobConfig()
    config.training.packing_bins = 4
    with pytest.raises(ConfigError, match="--training.packing_bins 4 does nothing"):
        validate(config)
