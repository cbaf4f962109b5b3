"""draft_model, eagle and eagle3 proposers, driven through the servicer's request handling.

A tiny random target (4 layers) is written to disk; draft checkpoints in the published
layouts (tests/support/draft_checkpoints.py) load through the real loaders. The test plays the
verifier: it computes the target's hidden states with our LlamaForCausalLM (aux_layer_ids),
sends them in ProposeRequests with the protocol's row semantics, accepts a random prefix of
each draft and appends a token, as sampling would.

Checks:
- a draft model identical to the target proposes exactly the target's greedy continuation
  at every step, across accept / reject / rollback and a full resync;
- EAGLE / EAGLE-3 heads propose what a dense re-implementation of the published code
  (SafeAILab/EAGLE cnets1.py / cnets.py, fed by transformers' hidden states) proposes;
- after any history of accepts and rejects a proposer drafts exactly what a fresh one
  fed the same context in one message drafts (the draft KV stays in step);
- d2t maps reduced-vocabulary drafts to the right target ids; a drafter with another
  vocabulary reports it and is refused by the verifier's check.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from drafter_svc.proposer import ModelOptions, Proposer
from drafter_svc.proposer_factory import proposer_factory
from drafter_svc.server import start_drafter_server, stop_drafter_server
from drafter_svc.propose_request import handle_propose_request
from specdec.config import SpeculativeConfig
from specdec.engine.kv_cache import KVCache
from specdec.errors import ConfigError, DrafterMismatchError, InvalidRequestError
from specdec.layers.attention import AttentionMetadata
from specdec.models import load_model, load_tokenizer, tokenizer_fingerprint
from specdec.models.eagle3 import aux_layer_ids_from_config, default_aux_layer_ids
from specdec.models.packed_linear import PackedLinear, mkldnn_supported
from specdec.rpc.tensors import decode_tensor, encode_tensor
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from tests.support.draft_checkpoints import make_draft_model, make_eagle3_head, make_eagle_head
from verifier_svc.drafting.drafter_pool import DrafterPool

K = 3
VOCAB = 96
TARGET_LAYERS = 4
EAGLE3_LAYERS = [0, 2, 3]  # tiny target: the default (2, L // 2, L - 3) needs L >= 6
PROMPTS = {11: [5, 17, 42, 8, 9, 23, 61], 12: [70, 3, 3, 14]}


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_draft_model(tmp_path_factory.mktemp("target"), vocab_size=VOCAB, num_layers=TARGET_LAYERS)


@pytest.fixture(scope="module")
def oracle(target_dir: Path) -> TargetOracle:
    return TargetOracle(target_dir)


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory, target_dir: Path) -> dict[str, tuple[Path, dict]]:
    """name -> (checkpoint dir, raw tensors) for every head flavour."""
    root = tmp_path_factory.mktemp("heads")
    made: dict[str, tuple[Path, dict]] = {}
    for name, kwargs in {
        "eagle_bias_bin": dict(fc_bias=True, with_embed=False, weights_format="bin"),
        "eagle_nobias_embed_st": dict(fc_bias=False, with_embed=True, weights_format="safetensors"),
    }.items():
        made[name] = (root / name, make_eagle_head(root / name, target_dir, **kwargs))
    for name, kwargs in {
        "eagle3_full": dict(draft_vocab_size=None, layer_ids=EAGLE3_LAYERS),
        "eagle3_reduced": dict(draft_vocab_size=40, layer_ids=EAGLE3_LAYERS, with_embed=True,
                               weights_format="bin"),
    }.items():
        made[name] = (root / name, make_eagle3_head(root / name, target_dir, **kwargs))
    return made


_FACTORIES: dict[tuple, Callable[[], Proposer]] = {}


def factory(method: str, model: Path, target_dir: Path, **options: object) -> Callable[[], Proposer]:
    """One loaded method per configuration for the whole module (weights load once, as in a server)."""
    key = (method, str(model), str(target_dir), tuple(sorted(options.items())))
    if key not in _FACTORIES:
        config = SpeculativeConfig.parse({"method": method, "model": str(model),
                                          "num_speculative_tokens": K})
        values: dict[str, object] = dict(target_model=str(target_dir), dtype="float32",
                                         device="cpu", num_blocks=64, block_size=4)
        values.update(options)
        _FACTORIES[key] = proposer_factory(config, ModelOptions(**values))  # type: ignore[arg-type]
    return _FACTORIES[key]


# ---------------------------------------------------------------- the verifier's side


class TargetOracle:
    """Our target model run over whole contexts: greedy tokens and hidden states."""

    def __init__(self, target_dir: Path) -> None:
        self.model = load_model(target_dir, torch.float32, torch.device("cpu"))
        self.kv_cache = KVCache.allocate(self.model.config, 64, 16, torch.float32, torch.device("cpu"))

    def _run(self, token_ids: list[int], aux_layer_ids: tuple[int, ...] = ()):
        count = len(token_ids)
        metadata = AttentionMetadata(
            slot_mapping=torch.arange(count), query_start_locs=[0, count], context_lens=[count],
            block_tables=[torch.arange(-(-count // 16))])
        with torch.inference_mode():
            return self.model(torch.tensor(token_ids), torch.arange(count), self.kv_cache, metadata,
                              aux_layer_ids)

    def hidden_states(self, token_ids: list[int], layer_ids: tuple[int, ...]) -> torch.Tensor:
        """[len, width]: -1 = final normed state, else the states entering those layers."""
        if layer_ids == (-1,):
            return self._run(token_ids)
        _, aux = self._run(token_ids, layer_ids)
        return torch.cat(aux, dim=-1)

    def greedy(self, token_ids: list[int], count: int) -> list[int]:
        tokens = list(token_ids)
        for _ in range(count):
            logits = self.model.compute_logits(self._run(tokens)[-1:])
            tokens.append(int(logits.argmax(-1)))
        return tokens[len(token_ids):]


class Driver:
    """Plays the verifier's half of the Propose protocol against one proposer."""

    def __init__(self, proposer: Proposer, oracle: TargetOracle, layer_ids: tuple[int, ...] = (),
                 dtype: torch.dtype = torch.float32) -> None:
        self.proposer, self.oracle, self.layer_ids, self.dtype = proposer, oracle, layer_ids, dtype
        self.synced: dict[int, int] = {}
        self.step_id = 0

    def step(self, contexts: dict[int, list[int]], accepted: dict[int, int] | None = None,
             k: int = K) -> dict[int, specdec_pb2.SequenceDraft]:
        self.step_id += 1
        request = specdec_pb2.ProposeRequest(step_id=self.step_id)
        for seq_id, tokens in contexts.items():
            synced = self.synced.get(seq_id, 0)
            update = request.sequences.add(
                seq_id=seq_id, new_token_ids=tokens[synced:], context_len=len(tokens),
                num_accepted_tokens=(accepted or {}).get(seq_id, 0), num_speculative_tokens=k)
            if self.layer_ids:
                # Rows for every position the drafter has none for, but the last.
                rows = self.oracle.hidden_states(tokens, self.layer_ids)[max(synced - 1, 0):len(tokens) - 1]
                encode_tensor(rows.to(self.dtype), update.hidden_states)
            self.synced[seq_id] = len(tokens)
        response = handle_propose_request(self.proposer, request)
        assert response.step_id == self.step_id
        return {draft.seq_id: draft for draft in response.drafts}


def play(driver: Driver, num_steps: int, seed: int, next_token: Callable[[list[int]], int] | None = None,
         check: Callable[[list[int], list[int]], None] | None = None) -> list[tuple[dict, dict]]:
    """Steps with a random accepted prefix and an appended token; returns (contexts, drafts) per step."""
    rng = random.Random(seed)
    contexts = {seq_id: list(prompt) for seq_id, prompt in PROMPTS.items()}
    accepted: dict[int, int] = {}
    history = []
    for _ in range(num_steps):
        drafts = driver.step(contexts, accepted)
        ids = {seq_id: list(drafts[seq_id].draft_token_ids) for seq_id in contexts}
        history.append(({seq_id: list(tokens) for seq_id, tokens in contexts.items()}, ids))
        for seq_id, tokens in contexts.items():
            draft = ids[seq_id]
            assert len(draft) == K and all(0 <= token < VOCAB for token in draft)
            if check is not None:
                check(tokens, draft)
            num_accepted = rng.randint(0, K)
            follow = next_token(tokens + draft[:num_accepted]) if next_token and rng.random() < 0.5 \
                else rng.randrange(3, VOCAB)
            tokens += draft[:num_accepted] + [follow]
            accepted[seq_id] = num_accepted
    return history


def assert_fresh_proposer_agrees(make: Callable[[], Proposer], oracle: TargetOracle,
                                 layer_ids: tuple[int, ...], history: list[tuple[dict, dict]]) -> None:
    """Drafts after any history == drafts of a fresh proposer given the same context at once."""
    for contexts, drafts in history:
        fresh = Driver(make(), oracle, layer_ids)
        got = fresh.step(contexts)
        for seq_id in contexts:
            assert list(got[seq_id].draft_token_ids) == drafts[seq_id]
        fresh.proposer.close()


# ---------------------------------------------------------------- draft_model


def test_identical_draft_model_proposes_the_target_greedy_continuation(target_dir, oracle) -> None:
    make = factory("draft_model", target_dir, target_dir)
    proposer = make()
    driver = Driver(proposer, oracle)

    def check(context: list[int], draft: list[int]) -> None:
        assert draft == oracle.greedy(context, K)  # every draft would be accepted

    history = play(driver, num_steps=6, seed=0, next_token=lambda ctx: oracle.greedy(ctx, 1)[0],
                   check=check)
    # A full resync (the verifier lost track) restarts the sequences from the whole context.
    contexts = {seq_id: tokens for seq_id, tokens in history[-1][0].items()}
    driver.synced.clear()
    drafts = driver.step(contexts)
    for seq_id, tokens in contexts.items():
        assert list(drafts[seq_id].draft_token_ids) == oracle.greedy(tokens, K)
    # A context length that disagrees with the drafter's state asks for a resync.
    response = handle_propose_request(proposer, specdec_pb2.ProposeRequest(step_id=99, sequences=[
        specdec_pb2.SequenceUpdate(seq_id=11, new_token_ids=[4], context_len=3, num_speculative_tokens=K)]))
    assert response.drafts[0].needs_resync and not response.drafts[0].draft_token_ids
    proposer.close()


def test_draft_model_state_matches_a_fresh_proposer(tmp_path, target_dir, oracle) -> None:
    other = make_draft_model(tmp_path / "draft", vocab_size=VOCAB, num_layers=2, seed=7)
    make = factory("draft_model", other, target_dir)
    proposer = make()
    history = play(Driver(proposer, oracle), num_steps=6, seed=1)
    assert_fresh_proposer_agrees(make, oracle, (), history)
    proposer.close()


def test_blocks_return_to_the_shared_pool(target_dir, oracle) -> None:
    make = factory("draft_model", target_dir, target_dir)
    proposer = make()
    pool = proposer._pool
    free_before = pool.block_manager.num_free_blocks
    Driver(proposer, oracle).step({1: list(range(3, 40))})
    assert pool.block_manager.num_free_blocks < free_before
    proposer.close()
    assert pool.block_manager.num_free_blocks == free_before


def test_draft_model_with_another_vocabulary_reports_it_and_is_refused(tmp_path, target_dir) -> None:
    other = make_draft_model(tmp_path / "small", vocab_size=80, num_layers=1, seed=3)
    info = factory("draft_model", other, target_dir)().info
    target_fingerprint = tokenizer_fingerprint(load_tokenizer(target_dir))
    assert info.vocab_size == 80
    assert info.tokenizer_fingerprint == tokenizer_fingerprint(load_tokenizer(other))
    assert info.tokenizer_fingerprint != target_fingerprint
    pool = DrafterPool([], vocab_size=VOCAB, tokenizer_fingerprint=target_fingerprint)
    error = pool.check_info(specdec_pb2.DrafterInfo(
        method=info.method, max_num_speculative_tokens=K, vocab_size=info.vocab_size,
        tokenizer_fingerprint=info.tokenizer_fingerprint))
    assert isinstance(error, DrafterMismatchError) and "vocab_size is 80" in error.message


def test_draft_sampling_sends_the_distribution_it_sampled_from(target_dir, oracle) -> None:
    proposer = factory("draft_model", target_dir, target_dir, draft_sampling=True, seed=5)()
    drafts = Driver(proposer, oracle).step({1: PROMPTS[11]})
    probs = decode_tensor(drafts[1].draft_probs, field="draft_probs", shape=(K, VOCAB))
    assert torch.allclose(probs.sum(-1), torch.ones(K), atol=1e-5)
    assert all(probs[i, token] > 0 for i, token in enumerate(drafts[1].draft_token_ids))
    proposer.close()


# ---------------------------------------------------------------- eagle / eagle3 references


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:  # [n, heads, d], positions 0..n-1
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    freqs = torch.arange(x.shape[0]).float()[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), -1)[:, None]
    rotated = torch.cat((-x[..., dim // 2:], x[..., :dim // 2]), -1)
    return x * emb.cos() + rotated * emb.sin()


def _dense_layer(t: dict, prefix: str, attn_input: torch.Tensor, residual: torch.Tensor,
                 num_heads: int = 4, num_kv_heads: int = 2) -> torch.Tensor:
    """residual + causal self-attention(attn_input), then the MLP block; HF Llama math, no cache."""
    n = attn_input.shape[0]
    q = (attn_input @ t[f"{prefix}self_attn.q_proj.weight"].T).view(n, num_heads, -1)
    k = (attn_input @ t[f"{prefix}self_attn.k_proj.weight"].T).view(n, num_kv_heads, -1)
    v = (attn_input @ t[f"{prefix}self_attn.v_proj.weight"].T).view(n, num_kv_heads, -1)
    q, k = _rope(q), _rope(k)
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True).transpose(0, 1).reshape(n, -1)
    hidden = residual + attn @ t[f"{prefix}self_attn.o_proj.weight"].T
    normed = _rms(hidden, t[f"{prefix}post_attention_layernorm.weight"])
    gate, up = normed @ t[f"{prefix}mlp.gate_proj.weight"].T, normed @ t[f"{prefix}mlp.up_proj.weight"].T
    return hidden + (F.silu(gate) * up) @ t[f"{prefix}mlp.down_proj.weight"].T


@pytest.fixture(scope="module")
def hf_target(target_dir: Path):
    return transformers.LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def hf_hidden_states(hf_target, token_ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' final (normed) state and hidden_states[i] (entering layer i), [len, H] each."""
    with torch.no_grad():
        out = hf_target.model(torch.tensor([token_ids]), output_hidden_states=True)
    return out.last_hidden_state[0], [state[0] for state in out.hidden_states]


def reference_eagle(t: dict, hf_target, token_ids: list[int], k: int) -> list[int]:
    """cnets1.py's drafting, greedy: pairs (token t+1, feature t), fc(embed first), no input norm
    on layer 0, target lm_head without a norm; the head's output is the next step's feature."""
    final, _ = hf_hidden_states(hf_target, token_ids)
    embed = t.get("embed_tokens.weight", hf_target.model.embed_tokens.weight.detach())
    lm_head = hf_target.lm_head.weight.detach()
    inputs, features, drafts = list(token_ids[1:]), final[:-1], []
    for _ in range(k):
        fused = F.linear(torch.cat((embed[inputs], features), -1), t["fc.weight"], t.get("fc.bias"))
        out = _dense_layer(t, "layers.0.", fused, fused)
        drafts.append(int((out[-1] @ lm_head.T).argmax()))
        inputs.append(drafts[-1])
        features = torch.cat((features, out[-1:]))
    return drafts


def reference_eagle3(t: dict, hf_target, token_ids: list[int], layer_ids: list[int], k: int) -> list[int]:
    """cnets.py's drafting, greedy: fc(states entering the layers), midlayer over
    concat(input_layernorm(embed), hidden_norm(hidden)), lm_head(norm(out)), d2t; later steps
    feed the pre-norm output."""
    _, states = hf_hidden_states(hf_target, token_ids)
    embed = t.get("embed_tokens.weight", hf_target.model.embed_tokens.weight.detach())
    aux = torch.cat([states[i] for i in layer_ids], -1)
    inputs, hidden, drafts = list(token_ids[1:]), aux[:-1] @ t["fc.weight"].T, []
    for _ in range(k):
        attn_input = torch.cat((_rms(embed[inputs], t["midlayer.input_layernorm.weight"]),
                                _rms(hidden, t["midlayer.hidden_norm.weight"])), -1)
        out = _dense_layer(t, "midlayer.", attn_input, hidden)
        draft_id = int((_rms(out[-1], t["norm.weight"]) @ t["lm_head.weight"].T).argmax())
        drafts.append(draft_id + int(t["d2t"][draft_id]) if "d2t" in t else draft_id)
        inputs.append(drafts[-1])
        hidden = torch.cat((hidden, out[-1:]))
    return drafts


def test_our_aux_states_are_transformers_hidden_states(oracle, hf_target) -> None:
    tokens = PROMPTS[11]
    final, states = hf_hidden_states(hf_target, tokens)
    # fp32 rounding only: our few-row projections sum in another order than transformers'.
    torch.testing.assert_close(oracle.hidden_states(tokens, (-1,)), final, atol=1e-4, rtol=1e-5)
    ours = oracle.hidden_states(tokens, tuple(EAGLE3_LAYERS))
    torch.testing.assert_close(ours, torch.cat([states[i] for i in EAGLE3_LAYERS], -1),
                               atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------- eagle / eagle3


EAGLE_HEADS = ["eagle_bias_bin", "eagle_nobias_embed_st"]
EAGLE3_HEADS = ["eagle3_full", "eagle3_reduced"]


@pytest.mark.parametrize("name", EAGLE_HEADS + EAGLE3_HEADS)
def test_head_matches_the_published_algorithm(name, heads, target_dir, oracle, hf_target) -> None:
    head_dir, tensors = heads[name]
    method = "eagle" if name in EAGLE_HEADS else "eagle3"
    layer_ids = (-1,) if method == "eagle" else tuple(EAGLE3_LAYERS)
    make = factory(method, head_dir, target_dir)
    proposer = make()
    assert proposer.info.hidden_state_layer_ids == layer_ids
    assert proposer.info.vocab_size == VOCAB
    assert proposer.info.tokenizer_fingerprint == tokenizer_fingerprint(load_tokenizer(target_dir))
    driver = Driver(proposer, oracle, layer_ids)
    drafts = driver.step({seq_id: list(prompt) for seq_id, prompt in PROMPTS.items()})
    for seq_id, prompt in PROMPTS.items():
        if method == "eagle":
            expected = reference_eagle(tensors, hf_target, prompt, K)
        else:
            expected = reference_eagle3(tensors, hf_target, prompt, EAGLE3_LAYERS, K)
        assert list(drafts[seq_id].draft_token_ids) == expected
    proposer.close()


@pytest.mark.parametrize("name", EAGLE_HEADS + EAGLE3_HEADS)
def test_head_state_stays_in_step_across_accept_reject(name, heads, target_dir, oracle) -> None:
    head_dir, _ = heads[name]
    method = "eagle" if name in EAGLE_HEADS else "eagle3"
    layer_ids = (-1,) if method == "eagle" else tuple(EAGLE3_LAYERS)
    make = factory(method, head_dir, target_dir)
    proposer = make()
    history = play(Driver(proposer, oracle, layer_ids), num_steps=5, seed=2,
                   next_token=lambda ctx: oracle.greedy(ctx, 1)[0])
    assert_fresh_proposer_agrees(make, oracle, layer_ids, history)
    proposer.close()


@pytest.mark.parametrize("name", ["draft_model", "eagle_bias_bin", "eagle3_reduced"])
def test_an_update_without_new_tokens_drafts_the_same_again(name, heads, target_dir, oracle) -> None:
    if name == "draft_model":
        method, model, layer_ids = "draft_model", target_dir, ()
    else:
        method = "eagle" if name in EAGLE_HEADS else "eagle3"
        model, layer_ids = heads[name][0], (-1,) if method == "eagle" else tuple(EAGLE3_LAYERS)
    proposer = factory(method, model, target_dir)()
    driver = Driver(proposer, oracle, layer_ids)
    contexts = {1: list(PROMPTS[11])}
    first = list(driver.step(contexts)[1].draft_token_ids)
    contexts[1] += first[:1] + [9]
    second = list(driver.step(contexts, {1: 1})[1].draft_token_ids)
    # The verifier asks again with nothing new (e.g. its answer came too late): same drafts.
    assert list(driver.step(contexts)[1].draft_token_ids) == second
    assert list(driver.step(contexts)[1].draft_token_ids) == second
    proposer.close()


def test_d2t_maps_draft_ids_to_target_ids(heads, target_dir, oracle) -> None:
    head_dir, tensors = heads["eagle3_reduced"]
    proposer = factory("eagle3", head_dir, target_dir)()
    head = proposer.head
    draft_ids = torch.arange(40)
    expected = draft_ids + tensors["d2t"]
    assert torch.equal(head.to_target_ids(draft_ids), expected)
    assert torch.equal(tensors["t2d"].nonzero().squeeze(-1), expected)
    history = play(Driver(proposer, oracle, tuple(EAGLE3_LAYERS)), num_steps=3, seed=3)
    in_draft_vocab = set(expected.tolist())
    assert all(set(draft) <= in_draft_vocab for _, drafts in history for draft in drafts.values())
    proposer.close()


def test_eagle3_sampling_probs_live_on_the_draft_vocabulary(heads, target_dir, oracle) -> None:
    head_dir, tensors = heads["eagle3_reduced"]
    proposer = factory("eagle3", head_dir, target_dir, draft_sampling=True, seed=1)()
    drafts = Driver(proposer, oracle, tuple(EAGLE3_LAYERS)).step({1: PROMPTS[11]})
    probs = decode_tensor(drafts[1].draft_probs, field="draft_probs", shape=(K, VOCAB))
    assert torch.allclose(probs.sum(-1), torch.ones(K), atol=1e-5)
    assert torch.all(probs[:, ~tensors["t2d"]] == 0)
    proposer.close()


def test_bfloat16_hidden_states_are_accepted(heads, target_dir, oracle) -> None:
    proposer = factory("eagle", heads["eagle_bias_bin"][0], target_dir)()
    drafts = Driver(proposer, oracle, (-1,), dtype=torch.bfloat16).step({1: PROMPTS[11]})
    assert len(drafts[1].draft_token_ids) == K
    proposer.close()


@pytest.mark.skipif(not mkldnn_supported(torch.bfloat16), reason="no oneDNN bf16 on this CPU")
@pytest.mark.parametrize("method, head, layer_ids", [
    ("draft_model", None, ()),
    ("eagle", "eagle_bias_bin", (-1,)),
    ("eagle3", "eagle3_reduced", tuple(EAGLE3_LAYERS)),
])
def test_bf16_drafters_run_on_packed_linears(method, head, layer_ids, heads, target_dir, oracle) -> None:
    model_dir = target_dir if head is None else heads[head][0]
    proposer = factory(method, model_dir, target_dir, dtype="bfloat16")()
    drafts = Driver(proposer, oracle, layer_ids, dtype=torch.bfloat16).step({1: PROMPTS[11]})
    assert len(drafts[1].draft_token_ids) == K
    drafter_model = proposer.model if method == "draft_model" else proposer.head
    assert any(isinstance(module, PackedLinear) for module in drafter_model.modules())
    proposer.close()


def _update(seq_id: int, tokens: list[int], context_len: int, rows: torch.Tensor | None):
    update = specdec_pb2.SequenceUpdate(seq_id=seq_id, new_token_ids=tokens, context_len=context_len,
                                        num_speculative_tokens=K)
    if rows is not None:
        encode_tensor(rows, update.hidden_states)
    return update


@pytest.mark.parametrize("rows, needle", [
    (None, "missing"),
    (torch.zeros(5, 32), "shape [5, 32], expected [6, 32]"),  # one row short
    (torch.zeros(7, 32), "shape [7, 32], expected [6, 32]"),  # a row for the last token too
    (torch.zeros(6, 16), "shape [6, 16], expected [6, 32]"),
    (torch.zeros(6, 32, dtype=torch.int32), "dtype 'int32'"),
])
def test_malformed_hidden_states_are_invalid_argument(rows, needle, heads, target_dir) -> None:
    proposer = factory("eagle", heads["eagle_bias_bin"][0], target_dir)()
    request = specdec_pb2.ProposeRequest(step_id=1, sequences=[_update(1, PROMPTS[11], 7, rows)])
    with pytest.raises(InvalidRequestError) as info:
        handle_propose_request(proposer, request)
    assert info.value.param == "sequences.hidden_states" and needle in info.value.message
    proposer.close()


@pytest.mark.parametrize("method, drop, needle", [
    ("eagle", "layers.0.mlp.up_proj.weight", "lacks tensors: layers.0.mlp.gate_up_proj.weight[1]"),
    ("eagle", "fc.weight", "lacks fc.weight"),
    ("eagle3", "midlayer.hidden_norm.weight", "lacks tensors: midlayer.hidden_norm.weight"),
])
def test_incomplete_heads_are_refused_naming_the_tensor(tmp_path, target_dir, method, drop, needle) -> None:
    head_dir = tmp_path / "head"
    if method == "eagle":
        tensors = make_eagle_head(head_dir, target_dir, fc_bias=False, with_embed=False,
                                  weights_format="safetensors")
    else:
        tensors = make_eagle3_head(head_dir, target_dir, draft_vocab_size=None, layer_ids=EAGLE3_LAYERS)
    del tensors[drop]
    save_file(tensors, str(head_dir / "model.safetensors"))
    config = SpeculativeConfig.parse({"method": method, "model": str(head_dir), "num_speculative_tokens": K})
    with pytest.raises(ConfigError, match=re.escape(needle)):
        proposer_factory(config, ModelOptions(target_model=str(target_dir), device="cpu"))


def test_aux_layer_ids_default_and_from_config() -> None:
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert aux_layer_ids_from_config({}, 32) == (2, 16, 29)
    assert aux_layer_ids_from_config({"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}, 32) == (1, 5, 9)
    assert aux_layer_ids_from_config({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 4, 5]}},
                                     32) == (3, 4, 5)
    with pytest.raises(ConfigError, match="must lie in"):
        aux_layer_ids_from_config({}, 2)  # the default (2, 1, -1) does not exist in 2 layers

# ---------------------------------------------------------------- through the real service


async def test_eagle3_drafter_service(heads, target_dir, oracle) -> None:
    config = SpeculativeConfig.parse({"method": "eagle3", "model": str(heads["eagle3_full"][0]),
                                      "num_speculative_tokens": K})
    options = ModelOptions(target_model=str(target_dir), dtype="float32", device="cpu",
                           num_blocks=32, block_size=4)
    server, port = await start_drafter_server(config, "127.0.0.1", 0, options=options)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = specdec_pb2_grpc.DrafterStub(channel)
            info = await stub.GetInfo(specdec_pb2.GetDrafterInfoRequest())
            assert (info.method, list(info.hidden_state_layer_ids), info.vocab_size) == \
                ("eagle3", EAGLE3_LAYERS, VOCAB)
            assert info.tokenizer_fingerprint == tokenizer_fingerprint(load_tokenizer(target_dir))
            call = stub.Propose()
            tokens = PROMPTS[11]
            rows = oracle.hidden_states(tokens, tuple(EAGLE3_LAYERS))[:-1]
            await call.write(specdec_pb2.ProposeRequest(step_id=1, sequences=[
                _update(1, tokens, len(tokens), rows)]))
            response = await call.read()
            assert len(response.drafts[0].draft_token_ids) == K
            await call.write(specdec_pb2.ProposeRequest(step_id=2, sequences=[
                _update(2, tokens, len(tokens), rows[:2])]))
            with pytest.raises(grpc.aio.AioRpcError) as info_error:
                await call.read()
            assert info_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sequences.hidden_states" in info_error.value.details()
    finally:
        await stop_drafter_server(server, grace_s=0)
