"""Runs one scheduled step on the model: a batched decode of the running sequences, fused into
the forward of the prefills, each of which pauses where its share of the step ends and writes
its KV into its blocks as it goes. Runs on the worker thread."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

import torch

from engine.blend.budget import StepBudget
from engine.blend.dense import Pausable, advance_together, side_by_side
from engine.blend.layout import SaltedChunk
from engine.blend.prefill import Prefill, PrefillAsk, Prefiller
from engine.blend.prompt_kv import PagedKV
from engine.quality.shadow import Shadow
from engine.runner.model_runner import ModelRunner
from engine.sched.estimate import QueueEstimate
from engine.sched.job import Job
from engine.sched.logprobs import prompt_logprobs
from engine.sched.postprocess import Postprocessor
from engine.sched.scheduler import Step, prefill_shares
from engine.types import StepRecord, TokenDelta

log = logging.getLogger(__name__)


class Executor:
    def __init__(
        self,
        prefiller: Prefiller,
        runner: ModelRunner,
        shadow: Shadow,
        write_back: Callable[[list[SaltedChunk]], None],
        post: Postprocessor,
        estimate: QueueEstimate,
        batch_tokens: int = 0,
    ):
        self.prefiller = prefiller
        self.runner = runner
        self.shadow = shadow
        # Queues the standalone KV of chunks a prefill found in no tier (ChunkPrecompute).
        self.write_back = write_back
        self.post = post
        # Consecutive prefills whose prompts total at most this many tokens run side by side.
        self.batch_tokens = batch_tokens
        self.estimate = estimate

    def run(self, step: Step[Job]) -> StepRecord:
        """The step's decode and its prefills, each within its share of the step's tokens,
        timed. With prefills to run, the decode rows are fused into their forward (decode_s 0:
        its time is in prefill_s); alone, or replayed from a CUDA graph, the decode runs first."""
        start = time.perf_counter()
        self.start_prefills(step)
        prefilling = bool(step.prefills)
        fused = bool(step.decodes and prefilling and self.runner.graphs is None)
        if step.decodes and not fused:
            self.decode(step.decodes)
        decode_s = time.perf_counter() - start
        completed_tokens = self.prefill(step, step.decodes if fused else []) if prefilling else 0
        return StepRecord(
            len(step.decodes),
            0.0 if fused else decode_s,
            len(step.prefills),
            completed_tokens,
            time.perf_counter() - start - decode_s,
        )

    def submit_shadows(self, finished: list[Job], busy: bool) -> None:
        """Queue the shadow check of each finished sequence sampled for one (not failed)."""
        for seq in finished:
            if seq.shadow is not None and seq.finish_reason != "error":
                self.shadow.submit(seq.shadow, busy)

    def start_prefills(self, step: Step[Job]) -> None:
        """Give the step's new prefills their pausable steps, and every prefill its share of
        the step (`Step.prefill_tokens`, counted once per layer). The KV streams of the new
        ones (opened parked when each was queued) start first, in order, so the store's one
        loader reads ahead for all."""
        seqs, num_layers = step.prefills, self.prefiller.ops.shape.num_layers
        for seq in seqs:
            if seq.prefill_steps is not None:
                continue
            seq.scheduled_s = time.perf_counter()
            request = seq.request
            if seq.opened is not None:
                seq.opened.start()  # looked up when the request was queued
            elif len(seqs) > 1:
                seq.opened = self.prefiller.open_ahead(seq.layout, PrefillAsk.of(request))
            # The loop writes the prompt's KV into the sequence's blocks layer by layer (those
            # of a shared prefix excepted): nothing is copied once it completes.
            blocks = PagedKV(
                (self.runner.keys, self.runner.values),
                seq.block_table,
                seq.num_prompt_tokens,
                shared=seq.num_shared_tokens,
            )
            seq.budget = StepBudget()
            seq.prefill_steps = self.prefiller.prefill(
                seq.layout, PrefillAsk.of(request), seq.budget, out=blocks, opened=seq.opened
            )
        for seq, tokens in zip(seqs, step.prefill_tokens, strict=True):
            assert seq.budget is not None
            seq.budget.refill(tokens * num_layers)

    def prefill(self, step: Step[Job], fused_decodes: list[Job]) -> int:
        """Advance each of the step's prefills within its share (start_prefills gave it), in
        admission order; consecutive ones whose prompts total at most `batch_tokens` side by
        side, their projections and MLPs of the same layer as one batch (dense.py), the decode
        of `fused_decodes` with the first of them; the prompt tokens of those that completed."""
        seqs, num_layers = step.prefills, self.prefiller.ops.shape.num_layers
        completed, first_tokens = 0, 0

        def done(batch: list[Job], index: int, prefill: Prefill | torch.Tensor) -> None:
            nonlocal completed, first_tokens
            if index == len(batch):
                self._decoded(fused_decodes, prefill)  # type: ignore[arg-type]
                return
            assert isinstance(prefill, Prefill)
            seq = batch[index]
            seq.prefill_steps = seq.opened = None
            try:
                self._accept(seq, prefill)
            except Exception as exc:  # completing one sequence fails that sequence only
                log.error("completing a prefill failed", exc_info=exc)
                self.post.fail(seq, exc)
                return
            completed += seq.num_prompt_tokens
            first_tokens += 1
            # It now waits for its next token: what is left of an unbounded step (nothing
            # decoded in it) is shared as if it decoded.
            if not step.decodes:
                self._bound(step, first_tokens)

        def failed(batch: list[Job], index: int, exc: Exception) -> None:
            if index == len(batch):
                self._decode_failed(fused_decodes, exc)
                return
            log.error("prefill failed", exc_info=exc)
            self.abandon(batch[index])
            self.post.fail(batch[index], exc)

        tokens = [seq.num_prompt_tokens for seq in seqs]
        batches = [[seqs[i] for i in group] for group in side_by_side(tokens, self.batch_tokens)]
        decode = self._decode_steps(fused_decodes) if fused_decodes else None
        with torch.inference_mode():
            for batch in batches:
                for seq in batch:
                    assert seq.budget is not None
                    # A layer's device time is one prefill's own only with nothing beside it.
                    seq.budget.alone = len(batch) == 1 and decode is None
                pausables: list[Pausable[Prefill | torch.Tensor]] = [
                    seq.prefill_steps  # type: ignore[misc]
                    for seq in batch
                ]
                if decode is not None:
                    pausables.append(decode)
                    decode = None
                advance_together(pausables, partial(done, batch), partial(failed, batch))
        if decode is not None:
            decode.close()
            self.decode(fused_decodes)
        for seq in seqs:
            if seq.budget is not None:
                seq.num_prefilled = seq.budget.used / num_layers
        return completed

    def _bound(self, step: Step[Job], num_decoding: int) -> None:
        """Share what a step leaves beside `num_decoding` decodes among its prefills still in
        flight (they had no bound: nothing decoded when the step began)."""
        running = [seq for seq in step.prefills if seq.prefill_steps is not None]
        needs = [max(seq.num_prompt_tokens - seq.num_prefilled, 1.0) for seq in running]
        shares = prefill_shares(needs, step.budget(num_decoding))
        num_layers = self.prefiller.ops.shape.num_layers
        for seq, tokens in zip(running, shares, strict=True):
            assert seq.budget is not None
            seq.budget.bound(tokens * num_layers)

    def abandon(self, seq: Job) -> None:
        """Stop `seq`'s prefill where it paused (cancelled): its KV streams are closed."""
        if seq.prefill_steps is not None:
            seq.prefill_steps.close()
        if seq.opened is not None:  # an unstarted prefill has not taken its stream over
            seq.opened.close()
        seq.prefill_steps = seq.opened = seq.budget = None

    def _accept(self, seq: Job, prefill: Prefill) -> None:
        """A completed prefill: its KV is in the sequence's blocks already; the first token
        comes from its logits."""
        request, output = seq.request, prefill.output
        assert seq.lane is not None and seq.scheduled_s is not None
        prefill.prefill_s = time.perf_counter() - seq.scheduled_s
        seq.prefill, seq.num_cached = prefill, seq.num_prompt_tokens
        self.write_back(prefill.missing_chunks)
        # Penalised or grammar-masked tokens are no greedy continuation that the shadow's full
        # prefill could match.
        kv = output.kv
        seq.shadow = self.shadow.sample(
            request.mode,
            seq.layout.token_ids,
            seq.sampler.temperature == 0.0 and seq.penalties.neutral and seq.grammar is None,
            prefill.blend.fell_back_to_full_prefill,
            lambda: kv.read(0, kv.num_tokens),
        )
        if output.prompt_logprobs is not None:
            tokenizer = seq.text.tokenizer
            found = prompt_logprobs(seq.layout.token_ids, output.prompt_logprobs, tokenizer)
            seq.prompt_logprobs = found
            seq.emit(TokenDelta("", None, prompt_logprobs=found))
        logits = output.logits
        if not seq.penalties.neutral:
            self.runner.penalties.start(seq.lane, seq.layout.token_ids)
        self.post.accept(seq, self.post.sampling_logits([seq], logits[None])[0], logits)

    def decode(self, seqs: list[Job]) -> None:
        """One token for every sequence, as one batch."""
        try:
            logits = self.runner.decode(
                [s.block_table for s in seqs],
                [s.num_cached for s in seqs],
                [s.next_token for s in seqs],  # type: ignore[misc]
            )
        except Exception as exc:
            self._decode_failed(seqs, exc)
            return
        self._decoded(seqs, logits)

    def _decode_steps(self, seqs: list[Job]) -> Pausable[torch.Tensor]:
        """`decode` as a pausable whose dense work joins the prefills' (engine/blend/dense.py)."""
        return self.runner.decode_steps(
            [s.block_table for s in seqs],
            [s.num_cached for s in seqs],
            [s.next_token for s in seqs],  # type: ignore[misc]
        )

    def _decoded(self, seqs: list[Job], logits: torch.Tensor) -> None:
        """Each sequence's token from the step's logits; a sequence whose completion fails
        (its sampling, its consumer) fails alone."""
        sampling = self.post.sampling_logits(seqs, logits)
        for seq, row, raw in zip(seqs, sampling, logits, strict=True):
            seq.num_cached += 1
            try:
                self.post.accept(seq, row, raw)
            except Exception as exc:
                log.error("completing a decoded token failed", exc_info=exc)
                self.post.fail(seq, exc)

    def _decode_failed(self, seqs: list[Job], exc: Exception) -> None:
        log.error("decode step failed", exc_info=exc)
        for seq in seqs:
            self.post.fail(seq, exc)
