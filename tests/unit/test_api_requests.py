"""What the service reads of a forward_backward before the engine runs it: the loss's config,
each datum's targets and inputs, stable_reinforce's provenance against the recorded samples."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_multilora.api.calls import OpError
from megatron_multilora.api.recorded_samples import RecordedSamples
from megatron_multilora.api.request_checks import Limits, Refused, datum_example, loss_config
from megatron_multilora.api.wire import Datum

LIMITS = Limits("tiny", 64, 128, slots=2, max_rank=8, tokenizer_id=None)


def rl_datum(tokens, targets, **more) -> Datum:
    n = len(tokens)
    inputs = {
        "target_tokens": np.asarray(targets, dtype=np.int64),
        "logprobs": np.full(n, -1.0, dtype=np.float32),
        "advantages": np.asarray([0.0] + [1.0] * (n - 1), dtype=np.float32),
        **{k: np.asarray(v, dtype=np.float32) for k, v in more.items()},
    }
    return Datum(list(tokens), inputs)


@pytest.mark.parametrize(
    ("loss", "config", "message"),
    [
        ("dro", {"clip_low_threshold": 0.8}, "clip_low_threshold: dro takes beta"),
        ("importance_sampling", {"beta": 1.0}, "takes no loss_fn_config"),
        ("ppo", {"clip_low_threshold": 1.2}, r"of ppo: clip_low_threshold=1.2: in \[0, 1\]"),
        ("gspo", {"clip_high_threshold": 0.9}, "clip_high_threshold=0.9: >= 1"),
        ("dro", {"beta": -1}, "beta=-1: >= 0"),
        ("cispo", {"clip_high_threshold": float("nan")}, "a finite number"),
        ("custom", {}, "this service computes"),
    ],
)
def test_a_bad_loss_config_is_refused_naming_it(loss, config, message):
    with pytest.raises(Refused, match=message) as err:
        loss_config(loss, config)
    assert err.value.status == 400


def test_each_loss_gets_its_defaults_and_the_clients_keys():
    assert loss_config("ppo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert loss_config("cispo", {"clip_high_threshold": 2}) == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 2.0,
    }
    assert loss_config("dro", {"beta": 0.1}) == {"beta": 0.1}


def test_any_targets_within_the_vocabulary_are_served():
    """rl_loop.py's datums: target 0 at the prompt's positions, the sampled tokens after."""
    tokens, targets = [5, 6, 7, 8], [0, 0, 8, 9]
    example = datum_example(0, rl_datum(tokens, targets), "importance_sampling", LIMITS)
    assert example["tokens"] == [5, 6, 7, 8, 9] and example["targets"] == targets
    shifted = datum_example(0, rl_datum(tokens, [6, 7, 8, 9]), "importance_sampling", LIMITS)
    assert shifted["targets"] is None  # the next tokens: nothing to carry
    with pytest.raises(Refused, match="token id 64 is outside the vocabulary"):
        datum_example(0, rl_datum(tokens, [0, 0, 8, 64]), "importance_sampling", LIMITS)


def test_inputs_a_loss_does_not_read_are_refused_by_name():
    datum = rl_datum([5, 6, 7], [6, 7, 8], clip_low_threshold=[0.5] * 3)
    with pytest.raises(Refused, match="clip_low_threshold: not served with ppo"):
        datum_example(0, datum, "ppo", LIMITS)


def test_gspos_ratio_mask_defaults_to_the_positions_it_trains():
    example = datum_example(0, rl_datum([5, 6, 7], [6, 7, 8]), "gspo", LIMITS)
    assert example["values"]["sequence_ratio_mask"] == (0.0, 1.0, 1.0)
    given = rl_datum([5, 6, 7], [6, 7, 8], sequence_ratio_mask=[0, 0, 1])
    assert datum_example(0, given, "gspo", LIMITS)["values"]["sequence_ratio_mask"] == (0, 0, 1)


def test_stable_reinforce_needs_provenance_that_tiles_the_datum():
    datum = rl_datum([5, 6, 7], [6, 7, 8])
    with pytest.raises(Refused, match="stable_reinforce needs provenance on every datum"):
        datum_example(0, datum, "stable_reinforce", LIMITS)
    datum.input_spans = [("prompt", "r:0", 0, 1), ("sampled", "r:0", 0, 2)]
    datum.target_spans = [("sampled", "r:0", 0, 2)]
    with pytest.raises(Refused, match="target_tokens provenance runs do not tile its 3"):
        datum_example(0, datum, "stable_reinforce", LIMITS)
    datum.target_spans = [("prompt", "r:0", 1, 0), ("sampled", "r:0", 0, 3)]
    assert datum_example(0, datum, "stable_reinforce", LIMITS)["spans"][1] == datum.target_spans


def recorded() -> RecordedSamples:
    samples = RecordedSamples()
    samples.record("s1", [5, 6], {"r:0": ([7, 8, 9], [-0.5, -0.25, -0.125])})
    return samples


# rl_loop.py's provenance of a prompt of 2 tokens and a sample of 3: the input is the prompt
# and the sample but its last token; the targets are 0 at the prompt's positions.
SPANS = (
    [("prompt", "r:0", 0, 2), ("sampled", "r:0", 0, 2)],
    [("prompt", "r:0", 1, 1), ("sampled", "r:0", 0, 3)],
)


def test_stable_reinforce_trains_on_the_recorded_log_probs():
    got = recorded().sampler_logprobs("s1", [5, 6, 7, 8], [0, 7, 8, 9], SPANS, [0.0] * 4, "d")
    assert got == (0.0, -0.5, -0.25, -0.125)


@pytest.mark.parametrize(
    ("session", "tokens", "targets", "message"),
    [
        ("s2", [5, 6, 7, 8], [0, 7, 8, 9], "names no recorded sample of this session"),
        ("s1", [5, 6, 7, 3], [0, 7, 8, 9], "model_input positions 2 to 3 are not the sampled"),
        ("s1", [5, 6, 7, 8], [0, 7, 3, 9], "targets positions 1 to 3 are not the sampled"),
    ],
)
def test_provenance_that_does_not_match_the_record_is_refused(session, tokens, targets, message):
    with pytest.raises(OpError, match=message):
        recorded().sampler_logprobs(session, tokens, targets, SPANS, [0.0] * 4, "d")


def test_recorded_samples_go_with_their_session_and_are_bounded(monkeypatch):
    samples = recorded()
    samples.forget("s1")
    with pytest.raises(OpError, match="names no recorded sample"):
        samples.sampler_logprobs("s1", [5, 6, 7, 8], [0, 7, 8, 9], SPANS, [0.0] * 4, "d")
    samples.per_session = 2
    for k in range(3):
        samples.record("s1", [1], {f"q:{k}": ([2], [-1.0])})
    assert list(samples.sessions["s1"]) == ["q:1", "q:2"]  # the newest per_session


def test_recorded_samples_are_compact_and_bounded_in_all_by_bytes():
    """4 bytes a token, 8 a log-prob (a call's prompt counted with each of its samples);
    past the byte bound the largest session's oldest samples go, the others' stay."""
    one = 4 * 2 + 4 * 3 + 8 * 3  # prompt, tokens, log-probs
    samples = RecordedSamples(max_bytes=3 * one)
    draw = ([7, 8, 9], [-0.5, -0.25, -0.125])
    samples.record("small", [5, 6], {"s:0": draw})
    assert samples.bytes == {"small": one}
    samples.record("big", [5, 6], {f"b:{k}": draw for k in range(3)})  # one sample too many
    assert list(samples.sessions["big"]) == ["b:1", "b:2"] and list(samples.sessions["small"])
    assert sum(samples.bytes.values()) <= samples.max_bytes
    # what is kept still serves provenance
    got = samples.sampler_logprobs(
        "small",
        [5, 6, 7, 8],
        [0, 7, 8, 9],
        [
            [("prompt", "s:0", 0, 2), ("sampled", "s:0", 0, 2)],
            [("prompt", "s:0", 1, 1), ("sampled", "s:0", 0, 3)],
        ],
        [0.0] * 4,
        "d",
    )
    assert got == (0.0, -0.5, -0.25, -0.125)


def lora(rank: int = 4, **parts: bool) -> SimpleNamespace:
    """A tinker LoraConfig's fields (its defaults: every part trained)."""
    return SimpleNamespace(
        rank=rank, **{"train_attn": True, "train_mlp": True, "train_unembed": True, **parts}
    )


def test_a_lora_config_names_the_parts_it_trains_and_only_those_served():
    from megatron_multilora.api.request_checks import lora_parts

    served = dataclasses.replace(LIMITS, unembed=True)
    assert lora_parts(lora(), served) == ["attn", "mlp", "unembed"]
    assert lora_parts(lora(train_mlp=False), served) == ["attn", "unembed"]
    with pytest.raises(Refused, match="adapts no output layer"):
        lora_parts(lora(), LIMITS)
    with pytest.raises(Refused, match="all off"):
        lora_parts(lora(train_attn=False, train_mlp=False, train_unembed=False), served)


def test_every_loss_config_key_has_its_range_and_a_provenance_loss_needs_provenance():
    """A loss's rules are its TokenLoss entry: its keys' ranges (one table for every key)
    and whether it reads recorded samples, which the request checks follow by flag."""
    from megatron_multilora.training.objectives.token_losses import CONFIG_RANGES, TOKEN_LOSSES

    for name, loss in TOKEN_LOSSES.items():
        assert set(loss.config) <= set(CONFIG_RANGES), name
        assert not loss.config_problems(loss.config), name  # the defaults are in range
    readers = [name for name, loss in TOKEN_LOSSES.items() if loss.provenance]
    assert readers == ["stable_reinforce"]
    with pytest.raises(Refused, match="stable_reinforce needs provenance on every datum"):
        datum_example(0, rl_datum([5, 6, 7], [6, 7, 8]), "stable_reinforce", LIMITS)
