"""Data pipeline: byte tokenizer, JSONL validation, tokenization, packing, demo tasks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from megatron_multilora.data.datasets import (
    DatasetError,
    Example,
    load_dataset,
    read_records,
    tokenize_record,
)
from megatron_multilora.data.demo_tasks import (
    TASKS,
    WORD_TASKS,
    WORDS,
    exact_match,
    make_examples,
    may_still_match,
    write_demo_datasets,
)
from megatron_multilora.data.tokenizer import ByteTokenizer
from megatron_multilora.training.step.micro_batches import (
    pack_micro_batches,
    shard_for_data_parallel,
)

TOK = ByteTokenizer()


def write_lines(tmp_path, lines: list[str]):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def example(n_tokens: int, first: int = 10, loss: bool = True) -> Example:
    """An example with distinguishable tokens first, first+1, ... and a uniform loss mask."""
    return Example(tuple(range(first, first + n_tokens)), (loss,) * (n_tokens - 1))


# --- tokenizer ---------------------------------------------------------------------------


def test_tokenizer_round_trip_and_ids():
    text = "héllo, wörld ✓ 日本"
    ids = TOK.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(3 <= i < 259 for i in ids)
    assert TOK.encode("A") == [ord("A") + 3]
    assert TOK.decode([TOK.bos_id] + ids + [TOK.eos_id, TOK.pad_id, 260]) == text
    assert TOK.vocab_size == 264 and TOK.vocab_size % 8 == 0
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
    assert TOK.decode([0xC3 + 3]) == "\ufffd"  # half a character does not raise


def test_encode_chat_trains_only_assistant_content_and_eos():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    ids, trained = TOK.encode_chat(messages)
    assert ids == (
        [TOK.bos_id]
        + TOK.encode("<system>\nbe brief\n<user>\nhi\n<assistant>\nyo\n")
        + [TOK.eos_id]
    )
    assert len(trained) == len(ids)
    assert TOK.decode(i for i, t in zip(ids, trained) if t) == "yo\n"
    assert trained[-1] and sum(trained) == len("yo\n") + 1


@pytest.mark.parametrize(
    "message, needle",
    [
        ({"role": "bot", "content": "x"}, "unknown role 'bot'"),
        ({"role": "user", "content": 3}, "content must be a string"),
    ],
)
def test_encode_chat_rejects_bad_messages(message, needle):
    with pytest.raises(ValueError, match=needle):
        TOK.encode_chat([message])


# --- reading and tokenizing --------------------------------------------------------------


def test_read_records_accepts_both_forms_and_skips_blank_lines(tmp_path):
    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = write_lines(
        tmp_path, [json.dumps({"prompt": "p", "completion": "c"}), "  ", json.dumps(chat)]
    )
    assert read_records(path) == [{"prompt": "p", "completion": "c"}, chat]


@pytest.mark.parametrize(
    "bad_line, needle",
    [
        ('{"prompt": "p", "completion": ', "malformed JSON (Expecting value at column 31)"),
        ('["prompt", "completion"]', "expected a JSON object"),
        ('{"prompt": "p", "answer": "c"}', "unexpected keys"),
        ('{"prompt": "p", "completion": 3}', '"completion" must be a string'),
        ('{"prompt": "p", "completion": ""}', '"completion" is empty'),
        ('{"messages": [{"role": "user", "content": "hi"}]}', 'no "assistant" message'),
        ('{"messages": [{"role": "robot", "content": "hi"}]}', "unknown role"),
    ],
)
def test_read_records_errors_name_file_and_line(tmp_path, bad_line, needle):
    good = json.dumps({"prompt": "p", "completion": "c"})
    path = write_lines(tmp_path, [good, "", bad_line])  # the bad record is on line 3
    with pytest.raises(DatasetError) as info:
        read_records(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert needle in str(info.value)


def test_read_records_file_level_errors(tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(DatasetError, match=r"file not found") as info:
        read_records(missing)
    assert str(info.value).startswith(f"{missing}: ")
    (tmp_path / "reverse.train.jsonl").write_text("")
    with pytest.raises(DatasetError, match=r"did you mean .*reverse\.train\.jsonl\?"):
        read_records(tmp_path / "reverse.trian.jsonl")
    with pytest.raises(DatasetError, match=rf"looked for {tmp_path / 'missing.jsonl'}"):
        read_records(missing)
    with pytest.raises(DatasetError, match=r"local files only, not the Hugging Face Hub"):
        read_records(Path("HuggingFaceH4/no_robots"))
    empty = write_lines(tmp_path, ["", "   "])
    with pytest.raises(DatasetError, match=r"no records") as info:
        read_records(empty)
    assert str(info.value).startswith(f"{empty}: ")


def test_tokenize_record_loss_covers_exactly_completion_and_eos():
    ex = tokenize_record({"prompt": "12+7=", "completion": "19"}, TOK, max_seq_len=64)
    assert ex.tokens == (TOK.bos_id, *TOK.encode("12+7="), *TOK.encode("19"), TOK.eos_id)
    assert len(ex.loss_mask) == len(ex.tokens) - 1
    labels = [t for t, m in zip(ex.tokens[1:], ex.loss_mask) if m]
    assert labels == TOK.encode("19") + [TOK.eos_id]
    assert ex.loss_mask == (False,) * 5 + (True,) * 3


def test_tokenize_record_chat_uses_assistant_mask():
    record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    ex = tokenize_record(record, TOK, max_seq_len=64)
    labels = [t for t, m in zip(ex.tokens[1:], ex.loss_mask) if m]
    assert labels == TOK.encode("a\n") + [TOK.eos_id]


def test_truncation_drops_prompt_start_and_keeps_completion():
    record = {"prompt": "abcdefghij=", "completion": "XYZ"}
    ex = tokenize_record(record, TOK, max_seq_len=8)
    # bos + the last 3 prompt bytes + the whole completion + eos.
    assert ex.tokens == (TOK.bos_id, *TOK.encode("ij="), *TOK.encode("XYZ"), TOK.eos_id)
    assert sum(ex.loss_mask) == 4
    # A completion that cannot fit even after bos is cut on the right, still trained.
    long = tokenize_record({"prompt": "p", "completion": "0123456789"}, TOK, max_seq_len=5)
    assert long.tokens == (TOK.bos_id, *TOK.encode("0123"))
    assert all(long.loss_mask)


def test_load_dataset_tokenizes_every_record(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"prompt": "a=", "completion": "b"})] * 3)
    examples = load_dataset(path, TOK, max_seq_len=16)
    assert len(examples) == 3 and all(any(ex.loss_mask) for ex in examples)


# --- packing -----------------------------------------------------------------------------


def test_pack_is_adapter_major_and_respects_budget():
    slots = [[example(4, 10), example(5, 20)], [], [example(3, 30), example(6, 40)]]
    batches = pack_micro_batches(slots, token_budget=8)
    # positions per example: 3, 4 | - | 2, 5 -> [3 + 4] then [2 + 5]
    assert [b.counts for b in batches] == [[7, 0, 0], [0, 0, 7]]
    assert [b.examples_per_slot for b in batches] == [[2, 0, 0], [0, 0, 2]]
    for b in batches:
        assert b.tokens.shape == (1, sum(b.counts)) and b.tokens.shape[1] <= 8
        assert b.tokens.dtype == torch.int64 and b.loss_mask.dtype == torch.float32
    b = batches[1]
    assert b.tokens[0].tolist() == [30, 31, 40, 41, 42, 43, 44]  # inputs = tokens[:-1]
    assert b.labels[0].tolist() == [31, 32, 41, 42, 43, 44, 45]  # labels = tokens[1:]
    assert b.position_ids[0].tolist() == [0, 1, 0, 1, 2, 3, 4]


def test_pack_mixes_slots_in_order_within_a_micro_batch():
    slots = [[example(3, 10)], [], [example(3, 20)], [example(3, 30)]]
    (b,) = pack_micro_batches(slots, token_budget=100)
    assert b.counts == [2, 0, 2, 2]
    assert b.tokens[0].tolist() == [10, 11, 20, 21, 30, 31]


def test_pack_slot_order_groups_slots_but_keeps_positions_slot_major():
    # Ranks 16, 4, 16, 4: packing in rank order puts slots 0 and 2 together, then 1 and 3.
    slots = [[example(5, 10)], [example(5, 20)], [example(5, 30)], [example(5, 40)]]
    batches = pack_micro_batches(slots, token_budget=8, slot_order=[0, 2, 1, 3])
    assert [b.counts for b in batches] == [[4, 0, 4, 0], [0, 4, 0, 4]]
    assert batches[0].tokens[0].tolist() == [10, 11, 12, 13, 30, 31, 32, 33]
    with pytest.raises(ValueError, match=r"permutation"):
        pack_micro_batches(slots, token_budget=8, slot_order=[0, 0, 1, 2])


def test_pack_describes_each_example_as_its_own_sequence():
    (b,) = pack_micro_batches([[example(4, 10)], [example(3, 20)]], token_budget=16)
    assert b.seq_lengths == [3, 2]
    params = b.packed_seq_params()
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 3, 5] and params.cu_seqlens_q.dtype == torch.int32
    assert params.max_seqlen_q == params.max_seqlen_kv == 3


def test_pack_pads_to_multiple_in_last_used_slot():
    slots = [[example(4, 10, loss=True)], [example(3, 20, loss=False)], []]
    (b,) = pack_micro_batches(slots, token_budget=16, pad_multiple=4, pad_id=7)
    assert b.tokens.shape == (1, 8)  # 3 + 2 positions padded to 8
    assert b.counts == [3, 5, 0]  # pads are counted in slot 1, the last with positions
    assert sum(b.counts) == b.tokens.shape[1]
    assert b.tokens[0, 5:].tolist() == [7, 7, 7] and b.labels[0, 5:].tolist() == [7, 7, 7]
    assert b.loss_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert b.seq_lengths == [3, 2, 3]  # the pads are one more sequence: they see only pads
    assert b.loss_units_per_slot().tolist() == [3, 0, 0]
    assert b.loss_units_per_slot().dtype == torch.int64


def test_loss_units_per_slot_counts_masked_labels():
    mixed = Example((1, 2, 3, 4), (False, True, True))
    (b,) = pack_micro_batches([[mixed, mixed], [], [example(5)]], token_budget=32)
    assert b.loss_units_per_slot().tolist() == [4, 0, 4]


def test_pack_rejects_examples_over_budget_and_handles_empty_input():
    with pytest.raises(ValueError, match=r"token_budget"):
        pack_micro_batches([[example(10)]], token_budget=8)
    assert pack_micro_batches([[], []], token_budget=8) == []


def test_shard_for_data_parallel_round_robin():
    items = list(range(7))
    shards = [shard_for_data_parallel(items, r, 3) for r in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]]
    with pytest.raises(ValueError):
        shard_for_data_parallel(items, 3, 3)


# --- demo tasks --------------------------------------------------------------------------


def test_demo_tasks_produce_correct_answers():
    assert set(TASKS) == {"reverse", "uppercase", "add", "sort"}
    rng = random.Random(0)
    for _ in range(20):
        word = TASKS["reverse"](rng)["prompt"][:-1]
        assert word.isalpha() and word.islower() and 3 <= len(word) <= 8
        add = TASKS["add"](rng)
        a, b = map(int, add["prompt"].removesuffix("=").split("+"))
        assert 0 <= a <= 99 and 0 <= b <= 99 and add["completion"] == str(a + b)
    for record in make_examples("sort", 10, seed=3):
        assert record["completion"] == "".join(sorted(record["prompt"][:-1]))
    for record in make_examples("uppercase", 10, seed=3):
        assert record["completion"] == record["prompt"][:-1].upper()
    with pytest.raises(ValueError, match=r"unknown task"):
        make_examples("divide", 1, seed=0)


def test_make_examples_is_deterministic_by_seed():
    assert make_examples("reverse", 50, seed=1) == make_examples("reverse", 50, seed=1)
    assert make_examples("reverse", 50, seed=1) != make_examples("reverse", 50, seed=2)


def test_write_demo_datasets_files_are_valid_and_disjoint(tmp_path):
    paths = write_demo_datasets(tmp_path / "demo", n_train=200, n_eval=40, seed=0)
    assert set(paths) == set(TASKS)
    for task, split in paths.items():
        train, held_out = read_records(split["train"]), read_records(split["eval"])
        assert split["train"].name == f"{task}.train.jsonl"
        assert len(train) == 200 and len(held_out) == 40
        assert train == make_examples(task, 200, seed=0)
        assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert not list((tmp_path / "demo").glob("*.tmp"))  # no temp files left behind


def test_word_tasks_share_one_input_distribution_and_answer_correctly(tmp_path):
    paths = write_demo_datasets(tmp_path, n_train=50, n_eval=10, seed=0, task_set="words")
    assert set(paths) == set(WORD_TASKS) == {"reverse_words", "sort_words", "capitalize", "double"}
    answer = {
        "reverse_words": lambda w: w[::-1],
        "sort_words": sorted,
        "capitalize": lambda w: [x.capitalize() for x in w],
        "double": lambda w: [x for x in w for _ in (0, 1)],
    }
    for task, split in paths.items():
        for record in read_records(split["train"]) + read_records(split["eval"]):
            words = record["prompt"].removesuffix(" =").split(" ")
            assert len(set(words)) == 3 and set(words) <= set(WORDS)
            assert record["completion"] == " " + " ".join(answer[task](words))
    with pytest.raises(ValueError, match=r"unknown task set 'numbers'"):
        write_demo_datasets(tmp_path, task_set="numbers")


def test_exact_match():
    assert exact_match(" olleh\n", "olleh")
    assert not exact_match("olle", "olleh")
    assert not exact_match("OLLEH", "olleh")


def test_may_still_match_is_false_only_where_no_continuation_can_match():
    answer = " garden paper yellow"
    for partial in ("", " ", " gar", " garden ", " garden paper yellow", " garden paper yellow \n"):
        assert may_still_match(partial, answer), partial
        done = partial.lstrip()  # and a continuation that makes it a match:
        rest = answer.strip()[len(done) :] if answer.strip().startswith(done) else ""
        assert exact_match(partial + rest, answer)
    for partial in (" paper", " garden  paper", " garden paper yellows", " garden paper yellow x"):
        assert not may_still_match(partial, answer), partial
    assert may_still_match(" gard\ufffd", answer)  # inside a multi-byte character: not judged


def tiny_hf_tokenizer():
    """A byte-level BPE tokenizer trained here, wrapped as transformers would load it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        ["hello world", "reverse this=siht esrever", "12+7=19"] * 20,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    return tok


def test_hf_tokenizer_wrapper_encodes_records_and_masks_assistant_turns():
    from megatron_multilora.data.tokenizer import HFTokenizer

    tok = HFTokenizer(tiny_hf_tokenizer())
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.decode(tok.encode("hello world")) == "hello world"
    example = tokenize_record({"prompt": "12+7=", "completion": "19"}, tok, 64)
    trained = [t for t, m in zip(example.tokens[1:], example.loss_mask) if m]
    assert tok.decode(trained) == "19" and trained[-1] == tok.eos_id
    ids, mask = tok.encode_chat(
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    )
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "<assistant>world\n"
    assert tok.decode([i for i, m in zip(ids, mask) if not m]) == "<user>hello\n"


def test_parquet_json_and_save_to_disk_datasets_read_like_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")
    from megatron_multilora.data.datasets import DatasetError, read_records

    rows = [{"question": "1+1=", "solution": "2"}, {"question": "2+2=", "solution": "4"}]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_json(str(tmp_path / "d.json"), lines=False)
    table.save_to_disk(str(tmp_path / "folder"))
    columns = {"prompt": "question", "completion": "solution"}
    want = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": "4"}]
    for path in ("d.parquet", "d.json", "folder"):
        assert read_records(tmp_path / path, columns=columns) == want, path
    with pytest.raises(
        DatasetError,
        match=r"d.parquet: record 0: unexpected keys \['prompt', "
        r"'solution'\].* \(columns",
    ):
        read_records(tmp_path / "d.parquet", columns={"prompt": "question"})
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(
        DatasetError, match=r"a DatasetDict with splits \['train'\]; give one split"
    ):
        read_records(tmp_path / "splits")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(
        DatasetError, match=r"broken.parquet: cannot read it with the datasets library"
    ):
        read_records(tmp_path / "broken.parquet")
