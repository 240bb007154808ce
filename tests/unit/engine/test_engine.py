"""The continuous-batching engine against full-sequence forwards of the same model."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from jetroll.shared.engine import engine as engine_module
from jetroll.shared.engine.engine import Engine
from jetroll.shared.engine.request import Request
from jetroll.shared.engine.sampler import sample_tokens
from jetroll.shared.model import decode_attention
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.checkpoint import WEIGHTS, load_state, save_pretrained
from jetroll.shared.model.model import CausalLM
from jetroll.shared.model.precision import PrecisionLinear
from jetroll.shared.numerics import Numerics
from jetroll.shared.seeds import derive_seed, uniforms

VOCAB = 40
EOS = 1


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed: int = 0, precision: Numerics | None = None) -> CausalLM:
    torch.manual_seed(seed)
    args = ModelArgs(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=128, max_position_embeddings=256, eos_token_id=EOS)
    model = CausalLM(args, precision).eval()
    with torch.no_grad():  # tied N(0, 1) embeddings give near one-hot softmaxes; soften them so sampling samples
        model.model.embed_tokens.weight.mul_(0.2)
    return model


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_logits(model: CausalLM, request: Request) -> torch.Tensor:
    """Logits [num_new, V] that the full forward gives at each generated position."""
    ids = request.prompt_ids + request.output_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0]
    return logits[len(request.prompt_ids) - 1 :]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_equal_full_forward(temperature: float) -> None:
    model = tiny_model()
    engine = Engine(model, EOS, max_batch=3, max_len=64)
    requests = [Request(f"r{i}", prompt(5 + i, i), 12, temperature=temperature, ignore_eos=True) for i in range(4)]
    engine.generate(requests)
    for request in requests:
        assert len(request.output_ids) == 12 and request.finish_reason == "length"
        logprobs = torch.log_softmax(full_logits(model, request) / temperature, dim=-1)
        expected = logprobs.gather(1, torch.tensor(request.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(request.logprobs), expected, atol=1e-5, rtol=0)


def test_greedy_is_deterministic_and_follows_argmax() -> None:
    model = tiny_model()
    outputs = []
    for seed in (0, 1):
        engine = Engine(model, EOS, max_batch=2, max_len=64, seed=seed)
        requests = [Request(f"g{i}", prompt(6, i), 16, temperature=0.0, ignore_eos=True) for i in range(2)]
        engine.generate(requests)
        outputs.append([r.output_ids for r in requests])
        for request in requests:
            assert full_logits(model, request).argmax(-1).tolist() == request.output_ids
    assert outputs[0] == outputs[1]


def test_continuous_batching_finishes_everything_and_joiners_match_solo_runs() -> None:
    model = tiny_model()
    engine = Engine(model, EOS, max_batch=2, max_len=64)
    lengths = [3, 9, 5, 7, 4]
    requests = [Request(f"c{i}", prompt(4 + i, 10 + i), n, temperature=0.0, ignore_eos=True)
                for i, n in enumerate(lengths)]
    engine.generate(requests)
    assert not engine.has_work and not engine.running
    for request, n in zip(requests, lengths, strict=True):
        assert len(request.output_ids) == n and request.finish_reason == "length"
        solo = Request("solo", request.prompt_ids, n, temperature=0.0, ignore_eos=True)
        Engine(model, EOS, max_batch=1, max_len=64).generate([solo])
        assert solo.output_ids == request.output_ids

    engine = Engine(model, EOS, max_batch=3, max_len=64)
    first = Request("first", prompt(8, 20), 10, temperature=0.0, ignore_eos=True)
    engine.add([first])
    for _ in range(4):
        engine.step()
    joiner = Request("joiner", prompt(3, 21), 6, temperature=0.0, ignore_eos=True)
    engine.add([joiner])
    while engine.has_work:
        engine.step()
    for request in (first, joiner):
        solo = Request("solo", request.prompt_ids, request.max_new_tokens, temperature=0.0, ignore_eos=True)
        Engine(model, EOS, max_batch=1, max_len=64).generate([solo])
        assert solo.output_ids == request.output_ids


def test_one_forward_prefills_every_waiting_group_and_siblings_share_its_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    engine = Engine(model, EOS, max_batch=6, max_len=64)
    prompts = [prompt(3, 30), prompt(7, 31), prompt(5, 32)]  # right-padded to 7 in one forward
    requests = [Request(f"g{g}s{s}", p, 6, temperature=1.0, ignore_eos=True)
                for g, p in enumerate(prompts) for s in range(2)]
    requests.append(Request("late", prompt(4, 33), 6, temperature=1.0, ignore_eos=True))  # no free slot left for it
    prefills = []
    hidden = model.hidden
    monkeypatch.setattr(model, "hidden", lambda ids, *a, **k: prefills.append(ids.shape) or hidden(ids, *a, **k))
    engine.add(requests)
    engine.step()
    assert prefills == [torch.Size([3, 7])]
    assert engine.running == requests[:-1] and list(engine.waiting) == requests[-1:]
    monkeypatch.setattr(model, "hidden", hidden)
    while engine.has_work:
        engine.step()
    for request in requests:
        logprobs = torch.log_softmax(full_logits(model, request), dim=-1)
        expected = logprobs.gather(1, torch.tensor(request.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(request.logprobs), expected, atol=1e-5, rtol=0)


def test_eos_stops_a_sequence_unless_ignored() -> None:
    model = tiny_model()
    probe = Request("probe", prompt(4, 3), 6, temperature=0.0, ignore_eos=True)
    Engine(model, EOS, max_batch=1, max_len=64).generate([probe])
    stop_id = probe.output_ids[2]  # treat the third greedy token as EOS
    request = Request("e", probe.prompt_ids, 6, temperature=0.0)
    Engine(model, stop_id, max_batch=1, max_len=64).generate([request])
    assert request.output_ids == probe.output_ids[: probe.output_ids.index(stop_id) + 1]
    assert request.finish_reason == "stop"


def test_top_p_never_samples_outside_the_nucleus() -> None:
    model = tiny_model()
    top_p = 0.6
    engine = Engine(model, EOS, max_batch=4, max_len=64, seed=3)
    requests = [Request(f"p{i}", prompt(4, 30 + i), 24, top_p=top_p, ignore_eos=True) for i in range(4)]
    engine.generate(requests)
    num_outside_if_unrestricted = 0
    for request in requests:
        probs = torch.softmax(full_logits(model, request), dim=-1)
        for row, token in zip(probs, request.output_ids, strict=True):
            # a token is in the nucleus iff the mass strictly more likely than it is below top_p
            assert row[row > row[token]].sum().item() < top_p + 1e-6
            num_outside_if_unrestricted += int((row.sort(descending=True).values.cumsum(0) < top_p).sum() < len(row))
    assert num_outside_if_unrestricted > 0  # the nucleus really excluded tokens


def test_sampled_tokens_follow_the_probabilities() -> None:
    """Inverse-CDF draws over 40000 streams: each token's frequency within 4 sigma of its probability, never a
    zero-probability token (unnormalised rows, as after top_p)."""
    probs = torch.tensor([0.0, 0.05, 0.0, 0.4, 0.15, 0.3, 0.1, 0.0]) * 3
    num = 40_000
    keys = np.array([derive_seed(7, "sample", f"r{i}") for i in range(num)], dtype=np.uint64)
    tokens = sample_tokens(probs.expand(num, -1), torch.from_numpy(uniforms(keys, np.zeros(num, dtype=np.uint64))))
    frequency = torch.bincount(tokens, minlength=len(probs)).double() / num
    expected = probs.double() / probs.sum()
    sigma = (expected * (1 - expected) / num).sqrt()
    assert (frequency - expected).abs().le(4 * sigma).all(), (frequency, expected)
    assert frequency[expected == 0].eq(0).all()


def test_a_sample_depends_on_its_seed_and_id_not_on_its_neighbours() -> None:
    """On the exact backend (batch-invariant logits) a request's tokens are the same alone, beside other requests,
    or joining mid-run; another engine seed or another request id draws other tokens."""
    model = tiny_model(precision=Numerics(backend="exact"))

    def run(seed: int, request_id: str, neighbours: int, join_after: int = 0) -> list[int]:
        engine = Engine(model, EOS, max_batch=4, max_len=64, seed=seed)
        engine.add([Request(f"n{i}", prompt(3 + i, 60 + i), 20, ignore_eos=True) for i in range(neighbours)])
        for _ in range(join_after):
            engine.step()
        request = Request(request_id, prompt(5, 50), 16, ignore_eos=True)
        engine.generate([request])
        return request.output_ids

    alone = run(seed=5, request_id="g0000001:0", neighbours=0)
    assert run(seed=5, request_id="g0000001:0", neighbours=3) == alone
    assert run(seed=5, request_id="g0000001:0", neighbours=2, join_after=4) == alone
    assert run(seed=6, request_id="g0000001:0", neighbours=0) != alone
    assert run(seed=5, request_id="g0000001:1", neighbours=0) != alone


@pytest.mark.parametrize("recompute_tokens", [8192, 24])  # 24: ragged chunks of one and two sequences
def test_swap_weights_recomputes_kv_and_tags_versions(recompute_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "RECOMPUTE_TOKENS", recompute_tokens)
    model, new_model = tiny_model(seed=0), tiny_model(seed=7)
    engine = Engine(model, EOS, max_batch=4, max_len=64)
    requests = [Request(f"s{i}", prompt(3 + 3 * i, 40 + i), 12, temperature=0.0, ignore_eos=True) for i in range(4)]
    engine.add(requests)
    for _ in range(6):
        engine.step()
    num_before = [len(r.output_ids) for r in requests]
    engine.swap_weights(new_model.state_dict(), version=1)

    last = torch.tensor([[r.output_ids[-1]] for r in engine.running])
    positions = torch.tensor([r.num_tokens - 1 for r in engine.running])
    with torch.inference_mode():
        logits = engine.model(last, positions, engine.cache)[:, 0]
        for slot, request in enumerate(engine.running):
            fresh = new_model(torch.tensor([request.prompt_ids + request.output_ids]))[0, -1]
            assert torch.allclose(logits[slot], fresh, atol=1e-4, rtol=0)

    while engine.has_work:
        engine.step()
    for request, before in zip(requests, num_before, strict=True):
        assert request.versions == [0] * before + [1] * (12 - before)
        after = full_logits(new_model, request)[before:]
        assert after.argmax(-1).tolist() == request.output_ids[before:]


def _storages(model: CausalLM) -> int:
    """Bytes in the distinct storages of the model's parameters and rounded [K, N] copies (oneDNN's packed copies,
    opaque, are the same either way)."""
    tensors = [*model.parameters(), *(weights.weight_t for weights in model.inference_weights())]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp8_unified"])
def test_shared_masters_hold_linears_once_and_change_no_product(mode: str, tmp_path: Path) -> None:
    """A rollout model's masters become views of the rounded copies: the same tokens and log-probs before and after
    a swap as a model that keeps its masters, the same published bytes, and the bytes of one copy of the block
    linears fewer (FP8 keeps its)."""
    precision = Numerics(mode=mode, weight_block=32, act_group=32)
    kept, shared, new_model = (tiny_model(seed, precision) for seed in (0, 0, 7))
    shared.share_inference_masters()
    engines = [Engine(m, EOS, max_batch=4, max_len=64, seed=3) for m in (kept, shared)]
    linears = [m for m in kept.modules() if isinstance(m, PrecisionLinear)]
    linear_bytes = sum(m.weight.nbytes for m in linears)
    saved = _storages(kept) - _storages(shared)
    assert saved == (0 if mode == "fp8_unified" else linear_bytes)

    outputs = []
    for engine in engines:
        requests = [Request(f"s{i}", prompt(4 + i, 60 + i), 16, temperature=1.0, ignore_eos=True) for i in range(4)]
        engine.add(requests)
        for _ in range(6):
            engine.step()
        engine.swap_weights(new_model.state_dict(), version=1)
        while engine.has_work:
            engine.step()
        outputs.append([(r.output_ids, r.logprobs, r.versions) for r in requests])
    assert outputs[0] == outputs[1]
    assert _storages(kept) - _storages(shared) == saved  # the swap left no second copy behind
    for model, name in ((kept, "kept"), (shared, "shared")):
        save_pretrained(model, None, tmp_path / name, publish=precision)
    published = [load_file(str(tmp_path / name / WEIGHTS)) for name in ("kept", "shared")]
    assert published[0].keys() == published[1].keys()
    assert all(torch.equal(published[0][k], published[1][k]) for k in published[0])

    load_state(shared, new_model.state_dict())  # outside inference mode, as a resume would
    shared.refresh_inference_weights()
    with torch.no_grad():
        ids = torch.tensor([prompt(12, 5)])
        assert torch.equal(shared(ids), new_model(ids))


@pytest.mark.slow  # about 20 s of compilation
def test_compiled_decode_matches_eager_across_batch_sizes_and_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile'd decode (graphs for 1, 2..7 and >= 8 rows; attention through the CPU kernel) gives eager's
    tokens and log-probs (attention through matmuls)."""
    kernel, kernel_calls = decode_attention.kernel, []

    def counted_kernel() -> object:
        kernel_calls.append(1)
        return kernel()

    monkeypatch.setattr(decode_attention, "kernel", counted_kernel)
    model = tiny_model()
    compiled = Engine(model, EOS, max_batch=10, max_len=64, compile=True)
    assert compiled.compile_s > 0
    eager = Engine(model, EOS, max_batch=10, max_len=64)
    runs, calls_per_engine = [], []
    for engine in (compiled, eager):
        kernel_calls.clear()
        # 12 requests over 10 slots with ragged lengths: batches shrink through 8 and 1, joiners arrive mid-run
        requests = [Request(f"r{i}", prompt(3 + i % 5, i), 4 + 2 * i, temperature=0.0, ignore_eos=True)
                    for i in range(12)]
        engine.generate(requests)
        runs.append(requests)
        calls_per_engine.append(len(kernel_calls))
    assert calls_per_engine[0] > 0 and calls_per_engine[1] == 0  # only the compiled decode runs the kernel
    for got, want in zip(*runs, strict=True):
        assert got.output_ids == want.output_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)


def test_an_avx2_process_gets_an_inductor_cache_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's cache key misses ATEN_CPU_CAPABILITY: an AVX2 process reusing AVX512 kernels decoded garbage."""
    from jetroll.services.cli import use_inductor_cache_of_this_cpu

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    use_inductor_cache_of_this_cpu()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # the native capability keeps torch's default
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    use_inductor_cache_of_this_cpu()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith("/avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    use_inductor_cache_of_this_cpu()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/mine"  # a user's choice wins
