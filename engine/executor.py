"""Runs one scheduled step on the model: a batched decode of the running sequences, riding in
the forward of the prefills, which pause where the step's budget ends and go into their KV
blocks once complete. Runs on the worker thread."""

from __future__ import annotations

import logging
import time
from functools import partial

import torch

from engine.budget import StepBudget, decode_slack_s
from engine.chunks import ChunkPrecompute
from engine.dense import Pausable, advance_together, side_by_side
from engine.estimate import QueueEstimate
from engine.job import Job
from engine.postprocess import Postprocessor
from engine.prefill import Prefill, Prefiller
from engine.prompt_kv import PagedKV
from engine.runner import ModelRunner
from engine.scheduler import Step
from engine.shadow import Shadow
from engine.types import StepRecord

log = logging.getLogger(__name__)


class Executor:
    def __init__(
        self,
        prefiller: Prefiller,
        runner: ModelRunner,
        shadow: Shadow,
        chunks: ChunkPrecompute,
        post: Postprocessor,
        estimate: QueueEstimate,
        batch_tokens: int = 0,
        slack_factor: float = 0.0,
    ):
        self.prefiller = prefiller
        self.runner = runner
        self.shadow = shadow
        self.chunks = chunks
        self.post = post
        # The budget every prefill in flight reads; each step refills it.
        self.batch_tokens = batch_tokens
        self.budget = StepBudget()
        # A decoding sequence's mean time per token may reach slack_factor x a decode step
        # alone (the estimate's running average) before its steps stop lending prefills time
        # (0: never).
        self.slack_factor = slack_factor
        self.estimate = estimate

    def run(self, step: Step[Job]) -> StepRecord:
        """The step's decode and its prefills within the tokens it leaves them, each timed. With
        prefills to run, the decode rows ride in their forward (decode_s 0: its time is in
        prefill_s); alone (the decoding sequences bank their slack: no prefill runs), or
        replayed from a CUDA graph, it runs first."""
        start = time.perf_counter()
        prefilling = self.start_prefills(step)
        ride = bool(step.decodes and prefilling and self.runner.graphs is None)
        if step.decodes and not ride:
            self.decode(step.decodes)
        decode_s = time.perf_counter() - start
        completed_tokens = self.prefill(step, step.decodes if ride else []) if prefilling else 0
        return StepRecord(
            len(step.decodes),
            0.0 if ride else decode_s,
            len(step.prefills) if prefilling else 0,
            completed_tokens,
            time.perf_counter() - start - decode_s,
            step.num_waiting + (0 if prefilling else len(step.prefills)),
        )

    def submit_shadows(self, finished: list[Job], busy: bool) -> None:
        """Queue the shadow check of each finished sequence sampled for one (not failed)."""
        for seq in finished:
            if seq.shadow is not None and seq.finish_reason != "error":
                self.shadow.submit(seq.shadow, busy)

    def start_prefills(self, step: Step[Job]) -> bool:
        """Give the step's new prefills their pausable steps and fill the step's budget: its
        prefill tokens, or the decoding sequences' slack (`StepBudget.lend`). Whether any
        prefill may run. The KV streams of the new ones are opened first, in order, so the
        store's one loader reads ahead for all (also while they wait)."""
        seqs = step.prefills
        new = [seq for seq in seqs if seq.prefill_steps is None]
        for seq in new:
            seq.scheduled_s = time.perf_counter()
            request = seq.request
            if len(seqs) > 1:
                seq.opened = self.prefiller.open_ahead(
                    seq.layout, request.mode, request.recompute_ratio, request.max_recompute_ratio
                )
            # The loop writes the prompt's KV into the sequence's blocks layer by layer (those
            # of a shared prefix excepted): nothing is copied once it completes.
            blocks = PagedKV(
                (self.runner.keys, self.runner.values),
                seq.block_table,
                seq.num_prompt_tokens,
                shared=seq.num_shared_tokens,
            )
            seq.prefill_steps = self.prefiller.request_steps(
                seq.layout, request, self.budget, out=blocks, opened=seq.opened
            )
        self.budget.refill(step.prefill_tokens * self.prefiller.ops.shape.num_layers)
        decode_s = self.estimate.decode_step_s
        unloaded_s = self.estimate.unloaded_decode_s or decode_s
        if self.slack_factor and decode_s and unloaded_s and step.decodes:
            running = [(s.first_token_s or 0.0, s.num_output_tokens) for s in step.decodes]
            target = self.slack_factor * unloaded_s
            # Steps that decode alone bank slack only where they take less than the target;
            # short prompts that fit the count whole are not worth banking for.
            fits = len(new) == len(seqs) and sum(s.num_prompt_tokens for s in seqs) <= (
                step.prefill_tokens
            )
            bank = decode_s < target and not fits
            self.budget.lend(decode_slack_s(running, target, time.perf_counter()), bank)
        return bool(seqs) and not self.budget.spent

    def prefill(self, step: Step[Job], riders: list[Job]) -> int:
        """Advance the step's prefills while its budget lasts (start_prefills filled it), in
        admission order; consecutive ones whose prompts total at most `batch_tokens` side by
        side, their projections and MLPs of the same layer as one batch (dense.py), the decode
        of `riders` with the first of them; the prompt tokens of those that completed."""
        seqs, num_layers = step.prefills, self.prefiller.ops.shape.num_layers
        completed, first_tokens = 0, 0

        def done(batch: list[Job], index: int, prefill: Prefill | torch.Tensor) -> None:
            nonlocal completed, first_tokens
            if index == len(batch):
                self._decoded(riders, prefill)  # type: ignore[arg-type]
                return
            assert isinstance(prefill, Prefill)
            seq = batch[index]
            seq.prefill_steps = seq.opened = None
            self._accept(seq, prefill)
            completed += seq.num_prompt_tokens
            first_tokens += 1
            # It now waits for its next token: what is left of an unbounded step (nothing
            # decoded in it) is bounded as if it decoded.
            self.budget.bound(step.budget(first_tokens) * num_layers)

        def failed(batch: list[Job], index: int, exc: Exception) -> None:
            if index == len(batch):
                self._decode_failed(riders, exc)
                return
            log.error("prefill failed", exc_info=exc)
            self.abandon(batch[index])
            self.post.fail(batch[index], exc)

        tokens = [seq.num_prompt_tokens for seq in seqs]
        batches = [[seqs[i] for i in group] for group in side_by_side(tokens, self.batch_tokens)]
        decode = self._decode_steps(riders) if riders else None
        with torch.inference_mode():
            for batch in batches:
                if self.budget.spent:
                    break
                # Only prefills side by side: a piece's time then holds another prompt's work.
                # Decode rows riding along are part of every bounded step's time.
                self.budget.shared = len(batch) > 1
                # A layer's device time is one prefill's own only with nothing beside it.
                self.budget.alone = len(batch) == 1 and decode is None
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
            self.decode(riders)
        return completed

    def abandon(self, seq: Job) -> None:
        """Stop `seq`'s prefill where it paused (cancelled): its KV streams are closed."""
        if seq.prefill_steps is not None:
            seq.prefill_steps.close()
        if seq.opened is not None:  # an unstarted prefill has not taken its stream over
            seq.opened.close()
        seq.prefill_steps = seq.opened = None

    def _accept(self, seq: Job, prefill: Prefill) -> None:
        """A completed prefill: its KV is in the sequence's blocks already; the first token
        comes from its logits."""
        request, output = seq.request, prefill.output
        assert seq.lane is not None and seq.scheduled_s is not None
        prefill.prefill_s = time.perf_counter() - seq.scheduled_s
        seq.prefill, seq.num_cached = prefill, seq.num_prompt_tokens
        self.chunks.write_back(prefill.missing_chunks)
        # Penalised tokens are no greedy continuation that the shadow's full prefill could match.
        kv = output.kv
        seq.shadow = self.shadow.sample(
            request.mode,
            seq.layout.token_ids,
            request.temperature == 0.0 and seq.penalties.neutral,
            prefill.blend.fell_back_to_full_prefill,
            lambda: kv.read(0, kv.num_tokens),
        )
        logits = output.logits
        if not seq.penalties.neutral:
            self.runner.penalties.start(seq.lane, seq.layout.token_ids)
        self.post.accept(seq, self.post.penalised([seq], logits[None])[0], logits)

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
        """`decode` as a pausable whose dense work joins the prefills' (engine/dense.py)."""
        return self.runner.decode_steps(
            [s.block_table for s in seqs],
            [s.num_cached for s in seqs],
            [s.next_token for s in seqs],  # type: ignore[misc]
        )

    def _decoded(self, seqs: list[Job], logits: torch.Tensor) -> None:
        penalised = self.post.penalised(seqs, logits)
        for seq, row, raw in zip(seqs, penalised, logits, strict=True):
            seq.num_cached += 1
            self.post.accept(seq, row, raw)

    def _decode_failed(self, seqs: list[Job], exc: Exception) -> None:
        log.error("decode step failed", exc_info=exc)
        for seq in seqs:
            self.post.fail(seq, exc)
