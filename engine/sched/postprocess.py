"""After the model ran: sample each sequence's next token, hand its text to the consumer, decide
whether it stops, and build the result of a finished sequence."""

from __future__ import annotations

import logging
import time

import torch

from engine.grammar.batch import GrammarMasks
from engine.runner.penalties import PenaltyState
from engine.sched.job import Job
from engine.sched.logprobs import generated_logprob
from engine.types import ChunkOrder, GenerateResult, Timings, TokenDelta

log = logging.getLogger(__name__)


class Postprocessor:
    def __init__(self, eos_ids: set[int], penalties: PenaltyState, grammars: GrammarMasks):
        self.eos_ids = eos_ids
        self.penalties = penalties
        self.grammars = grammars

    def sampling_logits(self, seqs: list[Job], logits: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] each sequence samples from: masked to what its grammar allows next
        (response_format), then penalised, each in one batched operation."""
        logits = self.grammars.apply([s.grammar for s in seqs], logits)
        lanes = [s.lane for s in seqs]
        return self.penalties.apply(logits, lanes, [s.penalties for s in seqs])  # type: ignore[arg-type]

    def accept(self, seq: Job, logits: torch.Tensor, raw_logits: torch.Tensor) -> None:
        """Sample the next token from the (penalised) logits, hand its text to the consumer, and
        decide whether to stop. The shadow check compares the model's own, raw logits."""
        token = seq.sampler(logits)
        if seq.shadow is not None:
            seq.shadow.observe(raw_logits, token)
        if seq.first_token_s is None:
            seq.first_token_s = time.perf_counter()
        top_n, entry = seq.request.logprobs, None
        if top_n is not None:
            entry = generated_logprob(seq.sampler, logits, token, top_n, seq.text.tokenizer)
            seq.logprobs.append(entry)
        if token in self.eos_ids and not seq.request.ignore_eos:
            # The EOS that ends it has a log-probability too (vLLM's output lists it).
            if entry is not None:
                seq.emit(TokenDelta("", token, entry))
            self.finish(seq, "stop")  # under a grammar, EOS was allowed: the output is complete
            return
        if seq.grammar is not None:
            seq.grammar.advance(token)
        seq.emit(TokenDelta(seq.text.add(token), token, entry))
        seq.num_output_tokens += 1
        if seq.text.stopped or (seq.grammar is not None and seq.grammar.complete):
            self.finish(seq, "stop")
        elif seq.num_output_tokens >= seq.max_tokens:
            self.finish(seq, "length")
        else:
            seq.next_token = token
            if not seq.penalties.neutral:
                self.penalties.add(seq.lane, token)  # type: ignore[arg-type]

    @staticmethod
    def fail(seq: Job, exc: Exception) -> None:
        """End `seq` with an error, handed to its consumer (a consumer that fails to take it
        is logged: the sequence ends all the same)."""
        seq.finish_reason = "error"
        try:
            seq.emit(exc)
        except Exception:
            log.exception("a failed sequence's consumer did not take its error")

    def finish(self, seq: Job, reason: str) -> None:
        seq.finish_reason = reason
        tail = seq.text.flush()
        if tail:
            seq.emit(TokenDelta(tail, None))
        seq.emit(result(seq))


def result(seq: Job) -> GenerateResult:
    """The finished sequence's text, usage, timings and blend report."""
    prefill, end = seq.prefill, time.perf_counter()
    assert prefill is not None and seq.first_token_s is not None
    assert seq.scheduled_s is not None and seq.finish_reason is not None
    usage = prefill.usage
    usage.completion_tokens = seq.num_output_tokens
    computes = prefill.output.layer_computes
    return GenerateResult(
        text=seq.text.text,
        finish_reason=seq.finish_reason,
        usage=usage,
        timings=Timings(
            ttft_s=seq.first_token_s - seq.arrival_s,
            queue_s=seq.scheduled_s - seq.arrival_s,
            prefill_s=prefill.prefill_s,
            kv_load_s=prefill.kv_load_s,
            kv_wait_s=prefill.output.kv_wait_s,
            recompute_s=sum(c.busy_s for c in computes),
            decode_s=end - seq.first_token_s,
            total_s=end - seq.arrival_s,
            overlap=prefill.overlap,
        ),
        blend=prefill.blend,
        token_ids=list(seq.text.token_ids),
        layers=prefill.timeline,
        chunk_tiers=in_request_order(prefill.chunk_tiers, seq.request.chunk_order),
        load_bytes_by_tier=prefill.load_bytes_by_tier,
        dropped_chunks=seq.layout.dropped_chunks,
        logprobs=None if seq.request.logprobs is None else seq.logprobs,
        prompt_logprobs=seq.prompt_logprobs,
        dropped_turns=seq.layout.dropped_turns,
    )


def in_request_order(per_chunk: list, order: ChunkOrder) -> list:
    """Per-chunk values of a prompt, in the order of the request's chunks."""
    return per_chunk[::-1] if order is ChunkOrder.BEST_LAST else per_chunk
