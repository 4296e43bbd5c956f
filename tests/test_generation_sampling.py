"""Sampling parameters and their errors, the batched choice of the next token (greedy, top-k, top-p, seeds), and the
output processor: whole UTF-8 characters from byte tokens, stop strings across tokens held back and never returned,
EOS, ignore_eos and max_tokens."""

from __future__ import annotations

import numpy as np
import pytest

from contract.tokenizer import EOS_ID, NUM_SPECIAL
from service.errors import BadRequestError, SamplingParamsError
from service.generate import EOS, LENGTH, STOP, SamplingParams
from service.generate.output import TextOutput
from service.generate.sampling import sample
from service.protocol import generate as oip
from service.protocol import openai

BAD = {
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens=0 must be an integer >= 1"),
    "max_tokens float": ({"max_tokens": 2.0}, "max_tokens=2.0"),
    "negative temperature": ({"temperature": -0.5}, "temperature=-0.5 must be a number >= 0"),
    "nan temperature": ({"temperature": float("nan")}, "temperature=nan"),
    "top_k negative": ({"top_k": -1}, "top_k=-1 must be an integer >= 0"),
    "top_p 0": ({"top_p": 0.0}, "top_p=0.0 must be a number in (0, 1]"),
    "top_p over 1": ({"top_p": 1.5}, "top_p=1.5"),
    "negative seed": ({"seed": -3}, "seed=-3 must be an integer in [0, 2**64)"),
    "seed as text": ({"seed": "7"}, "seed='7'"),
    "empty stop string": ({"stop": [""]}, "has 0 characters, it must have 1 to 256"),
    "too many stops": ({"stop": [str(i) for i in range(17)]}, "stop has 17 strings, at most 16"),
    "stop not strings": ({"stop": [1]}, "stop=(1,) must be a string or a list of strings"),
    "ignore_eos not a bool": ({"ignore_eos": 1}, "ignore_eos=1 must be true or false"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_sampling_parameters_are_a_400_naming_the_value(case):
    kwargs, said = BAD[case]
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert said in str(err.value)
    assert isinstance(err.value, ValueError) and isinstance(err.value, BadRequestError) and err.value.status == 400


def test_a_stop_given_as_a_string_or_a_list_is_kept_as_a_tuple():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_no_stop_given_is_null_and_a_lone_empty_stop_string_is_a_400_as_a_list_holding_one_is():
    assert SamplingParams(stop=None).stop == ()
    for stop in ("", [""]):
        with pytest.raises(SamplingParamsError, match="stop string '' has 0 characters"):
            SamplingParams(stop=stop)


@pytest.mark.parametrize("wire", ["openai", "oip"])
def test_an_empty_stop_string_from_either_wire_format_is_a_400_not_dropped(wire):
    """The wire formats pass `stop` as it came (null for none), so that a lone "" reaches SamplingParams."""
    for stop in ("", [""]):
        with pytest.raises(SamplingParamsError, match="stop string '' has 0 characters"):
            if wire == "openai":
                openai.to_requests(openai.CompletionRequest(model="lm", prompt="hi", stop=stop))
            else:
                oip.to_request(oip.GenerateBody(text_input="hi", parameters={"stop": stop}))


def _logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, (rows, vocab)).astype(np.float32)  # (n, V)


def test_greedy_rows_take_the_argmax_and_draw_nothing():
    logits = _logits()
    params = [SamplingParams(temperature=0)] * 3
    generators = [p.generator() for p in params]
    states = [g.bit_generator.state for g in generators]
    assert sample(logits, params, generators).tolist() == logits.argmax(axis=1).tolist()
    assert [g.bit_generator.state for g in generators] == states


def test_top_k_1_and_a_tiny_top_p_are_greedy_at_any_temperature():
    logits = _logits()
    for params in (SamplingParams(temperature=5.0, top_k=1), SamplingParams(temperature=5.0, top_p=1e-6)):
        rows = [params] * 3
        assert sample(logits, rows, [params.generator() for _ in rows]).tolist() == logits.argmax(axis=1).tolist()


@pytest.mark.parametrize("temperature", [1e-308, 5e-324])
def test_a_vanishing_temperature_gives_the_greedy_tokens_on_every_row(temperature):
    """logits / temperature overflows float64 (to +-inf, then inf - inf = NaN probabilities) unless the max is taken
    off first."""
    logits = _logits(rows=8, vocab=300) * 10  # (8, 300): logits of +-30, far past what a 1e-308 divisor keeps finite
    params = [SamplingParams(temperature=temperature, seed=row) for row in range(8)]
    tokens = sample(logits, params, [p.generator() for p in params])
    assert tokens.tolist() == logits.argmax(axis=1).tolist()


def test_top_k_keeps_only_the_k_most_likely_tokens():
    logits = _logits(rows=1)
    params = SamplingParams(temperature=10.0, top_k=3, seed=1)
    rng = params.generator()
    seen = {int(sample(logits, [params], [rng])[0]) for _ in range(300)}
    assert seen == set(np.argsort(-logits[0])[:3].tolist())


def test_a_row_draws_the_same_tokens_whatever_the_other_rows_are():
    alone_logits, params = _logits(rows=1, seed=5), SamplingParams(seed=42)
    rng = params.generator()
    alone = [int(sample(alone_logits, [params], [rng])[0]) for _ in range(50)]
    others = [SamplingParams(seed=1), SamplingParams(temperature=0), SamplingParams(top_k=5)]
    rngs = [p.generator() for p in [params, *others]]
    batched = []
    for step in range(50):
        logits = np.concatenate([alone_logits, _logits(rows=3, seed=100 + step)])  # (4, V)
        batched.append(int(sample(logits, [params, *others], rngs)[0]))
    assert batched == alone and len(set(alone)) > 5


def _byte_ids(text: str) -> list[int]:
    return [b + NUM_SPECIAL for b in text.encode("utf-8")]


def _feed(output: TextOutput, ids: list[int]) -> list[tuple[str, str | None]]:
    deltas = []
    for token in ids:
        delta = output.add(token)
        deltas.append((delta.text, delta.finish_reason))
        if delta.finish_reason:
            break
    return deltas


def _output(**params) -> TextOutput:
    return TextOutput(SamplingParams(**{"max_tokens": 100, **params}), EOS_ID, takes_text=True)


def test_a_character_split_across_tokens_is_emitted_whole():
    deltas = _feed(_output(), _byte_ids("é✓a"))
    assert deltas == [("", None), ("é", None), ("", None), ("", None), ("✓", None), ("a", None)]


def test_a_stop_string_across_tokens_ends_the_text_before_it():
    output = _output(stop=["lo w"])
    deltas = _feed(output, _byte_ids("hello world"))
    assert "".join(t for t, _ in deltas) == "hel"
    assert deltas[-1][1] == STOP and output.tokens == len("hello w")


def test_text_that_only_begins_a_stop_string_is_held_back_then_returned():
    deltas = _feed(_output(stop=["abc", "xyz"]), _byte_ids("ab!"))
    assert deltas == [("", None), ("", None), ("ab!", None)]


def test_the_earliest_of_several_stop_strings_wins_and_a_multibyte_stop_is_found():
    deltas = _feed(_output(stop=["✓", "end"]), _byte_ids("the end ✓"))
    assert "".join(t for t, _ in deltas) == "the " and deltas[-1][1] == STOP
    deltas = _feed(_output(stop=["✓"]), _byte_ids("ok ✓ more"))
    assert "".join(t for t, _ in deltas) == "ok " and deltas[-1][1] == STOP


def test_max_tokens_ends_with_length_and_releases_held_and_incomplete_text():
    deltas = _feed(_output(max_tokens=3, stop=["ab"]), _byte_ids("xya"))
    assert deltas[-1] == ("a", LENGTH)
    deltas = _feed(_output(max_tokens=2), _byte_ids("a✓"))  # the check mark's first byte only
    assert "".join(t for t, _ in deltas) == "a\ufffd" and deltas[-1][1] == LENGTH


def test_eos_ends_the_text_unless_ignore_eos():
    deltas = _feed(_output(stop=["q!"]), [*_byte_ids("hi q"), EOS_ID, *_byte_ids("more")])
    assert deltas[-1] == ("q", EOS) and "".join(t for t, _ in deltas) == "hi q"
    output = _output(ignore_eos=True, max_tokens=4)
    deltas = _feed(output, [*_byte_ids("hi"), EOS_ID, *_byte_ids("!")])
    assert "".join(t for t, _ in deltas) == "hi!" and deltas[-1][1] == LENGTH and output.tokens == 4
