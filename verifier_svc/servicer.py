"""Thin gRPC servicer: converts between proto messages and the engine's objects.

A Generate call ends its sequence (and frees its KV blocks) however it ends: finished,
cancelled by the client, the client gone, its deadline passed or the engine failing it.
The deadline is the earlier of the client's gRPC deadline and `--request-timeout-s`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator

import grpc

from specdec.engine.sampling_params import PARAMETERS, SamplingParams
from specdec.engine.sequence import FinishReason, SpeculationCounters
from specdec.errors import SpecdecError
from specdec.rpc.grpc_status import abort_with
from specdec.v1 import specdec_pb2, specdec_pb2_grpc
from verifier_svc.builder import ServedModel
from specdec.engine.engine import Engine

logger = logging.getLogger(__name__)

_FINISH_REASONS = {
    None: specdec_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: specdec_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: specdec_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: specdec_pb2.FINISH_REASON_ABORT,
}


def sampling_params_from_proto(message: specdec_pb2.SamplingParams, max_model_len: int,
                               prompt_len: int) -> SamplingParams:
    """The wire's parameters as the engine takes them; building the SamplingParams checks
    them by the rules the gateway applies to a request's JSON. Proto3 cannot tell 0 from
    unset: a 0 outside a parameter's bounds means its default (top_p and repetition_penalty
    1.0), max_tokens 0 "up to max_model_len" (see the .proto); seed and logprobs are set
    or not."""
    values: dict[str, float | int] = {}
    for name, parameter in PARAMETERS.items():
        if message.DESCRIPTOR.fields_by_name[name].has_presence and not message.HasField(name):
            continue
        value = getattr(message, name)
        if value != 0 or 0 in parameter.bounds:
            values[name] = value
    values.setdefault("max_tokens", max(1, max_model_len - prompt_len))
    return SamplingParams(**values, stop_token_ids=tuple(message.stop_token_ids),  # type: ignore[arg-type]
                          ignore_eos=message.ignore_eos,
                          logit_bias=tuple(message.logit_bias.items()))


def speculation_to_proto(spec: SpeculationCounters,
                         steps_from: int | None = None) -> specdec_pb2.SpeculationStats:
    """The counters so far, and with `steps_from` the steps recorded from that one on."""
    stats = specdec_pb2.SpeculationStats(
        num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
        num_accepted_tokens=spec.num_accepted_tokens,
        accepted_per_position=spec.accepted_per_position,
        num_forced_tokens=spec.num_forced_tokens, policy=spec.policy,
        policy_state=spec.policy_state)
    if steps_from is not None and spec.steps:
        stats.per_step_drafted.extend(drafted for drafted, _ in spec.steps[steps_from:])
        stats.per_step_accepted.extend(accepted for _, accepted in spec.steps[steps_from:])
    return stats


class VerifierServicer(specdec_pb2_grpc.VerifierServicer):
    def __init__(self, engine: Engine, served: ServedModel) -> None:
        self.engine = engine
        self.served = served
        self._request_ids = itertools.count()

    async def GetInfo(self, request: specdec_pb2.GetVerifierInfoRequest,
                      context: grpc.aio.ServicerContext) -> specdec_pb2.VerifierInfo:
        served = self.served
        return specdec_pb2.VerifierInfo(
            model_name=served.model_name, max_model_len=served.max_model_len,
            vocab_size=served.vocab_size, eos_token_ids=served.eos_token_ids,
            speculative_method=served.speculative_method,
            num_speculative_tokens=served.num_speculative_tokens,
            tokenizer_fingerprint=served.tokenizer_fingerprint,
            max_num_seqs=self.engine.config.max_num_seqs, deterministic=served.deterministic)

    async def Generate(self, request: specdec_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext,
                       ) -> AsyncIterator[specdec_pb2.GenerateResponse]:
        request_id = request.request_id or f"req-{next(self._request_ids)}"
        prompt = list(request.prompt_token_ids)
        try:
            params = sampling_params_from_proto(request.sampling, self.served.max_model_len,
                                                len(prompt))
            num_spec = _speculation_override(request.speculation)
            grammar = None
            if request.sampling.grammar.kind:
                grammar = await self.engine.compile_grammar(request.sampling.grammar.kind,
                                                            request.sampling.grammar.value)
            seq_id, queue = self.engine.add_request(request_id, prompt, params, num_spec,
                                                    grammar, request.cache_salt)
        except SpecdecError as exc:
            await abort_with(context, exc)
            return
        deadline, deadline_message = self._deadline(context)
        steps_sent = 0  # of output.spec.steps, with record_steps
        try:
            while True:
                if deadline is None:
                    output = await queue.get()
                else:
                    try:
                        async with asyncio.timeout_at(deadline):
                            output = await queue.get()
                    except TimeoutError:
                        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, deadline_message)
                        return
                if isinstance(output, SpecdecError):
                    await abort_with(context, output)
                    return
                response = specdec_pb2.GenerateResponse(
                    token_ids=output.token_ids,
                    finish_reason=_FINISH_REASONS[output.finish_reason])
                if output.logprobs is not None:
                    response.logprobs.extend(
                        specdec_pb2.TokenLogprob(logprob=entry.logprob,
                                                 top_token_ids=entry.top_token_ids,
                                                 top_logprobs=entry.top_logprobs)
                        for entry in output.logprobs)
                if output.finish_reason is not None:
                    response.usage.prompt_tokens = output.num_prompt_tokens
                    response.usage.completion_tokens = output.num_output_tokens
                    response.usage.cached_tokens = output.num_cached_tokens
                # The last response always: the policy's reason may have changed since.
                if (output.spec.num_drafts or output.spec.num_forced_tokens or output.spec.policy
                        or output.finish_reason is not None):
                    response.speculation.CopyFrom(speculation_to_proto(
                        output.spec, steps_sent if request.speculation.record_steps else None))
                    steps_sent = len(output.spec.steps or ())
                yield response
                if output.finish_reason is not None:
                    return
        finally:
            # Cancelled, timed out or failed mid-stream: free the sequence's blocks now.
            self.engine.abort(seq_id)

    def _deadline(self, context: grpc.aio.ServicerContext) -> tuple[float | None, str]:
        """The loop time at which this call is ended, and what its client is told then."""
        server_timeout = self.engine.config.request_timeout_s
        client_timeout = context.time_remaining()
        now = asyncio.get_running_loop().time()
        if client_timeout is not None and (server_timeout is None
                                           or client_timeout < server_timeout):
            return now + client_timeout, "the client's deadline passed"
        if server_timeout is not None:
            return now + server_timeout, (f"the request ran longer than the server's "
                                          f"--request-timeout-s ({server_timeout:g} s)")
        return None, ""


def _speculation_override(message: specdec_pb2.SpeculationOverride) -> int | None:
    if message.HasField("enabled") and not message.enabled:
        return 0
    if message.HasField("num_speculative_tokens"):
        return message.num_speculative_tokens
    return None

