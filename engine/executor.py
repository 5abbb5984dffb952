"""Runs the sequences of one scheduled step on the model: their prefills into KV-pool slots, or
one batched decode, each followed by postprocessing. Runs on the worker thread."""

from __future__ import annotations

import logging
import time

from engine.chunks import ChunkPrecompute
from engine.job import Job
from engine.postprocess import Postprocessor
from engine.prefill import Prefiller
from engine.runner import ModelRunner
from engine.shadow import Shadow
from engine.types import StepRecord
from kvstore.loader import KVLayerStream

log = logging.getLogger(__name__)


class Executor:
    def __init__(
        self,
        prefiller: Prefiller,
        runner: ModelRunner,
        shadow: Shadow,
        chunks: ChunkPrecompute,
        post: Postprocessor,
    ):
        self.prefiller = prefiller
        self.runner = runner
        self.shadow = shadow
        self.chunks = chunks
        self.post = post

    def run(self, seqs: list[Job], is_prefill: bool) -> StepRecord:
        """The step's prefills or its decode, timed."""
        start = time.perf_counter()
        num_tokens = self.prefill(seqs) if is_prefill else self.decode(seqs)
        return StepRecord(is_prefill, len(seqs), num_tokens, time.perf_counter() - start)

    def submit_shadows(self, finished: list[Job], busy: bool) -> None:
        """Queue the shadow check of each finished sequence sampled for one (not failed)."""
        for seq in finished:
            if seq.shadow is not None and seq.finish_reason != "error":
                self.shadow.submit(seq.shadow, busy)

    def prefill(self, seqs: list[Job]) -> int:
        """Prefill the step's sequences one after the other; the prompt tokens fed. Their KV
        streams are all opened first, in order, so the store's one loader reads the next
        prompt's first layers while the current one computes."""
        ahead: list[KVLayerStream | None] = []
        try:
            for seq in seqs:
                request = seq.request
                ahead.append(
                    self.prefiller.open_ahead(
                        seq.layout,
                        request.mode,
                        request.recompute_ratio,
                        request.max_recompute_ratio,
                    )
                    if len(seqs) > 1
                    else None
                )
            for seq, stream in zip(seqs, ahead, strict=True):
                self._prefill(seq, stream)
        finally:
            for stream in ahead:  # the prefill closed those it took; closing is idempotent
                if stream is not None:
                    stream.close()
        return sum(seq.num_prompt_tokens for seq in seqs)

    def _prefill(self, seq: Job, opened: KVLayerStream | None) -> None:
        seq.scheduled_s = time.perf_counter()
        request, num_tokens = seq.request, seq.num_prompt_tokens
        assert seq.slot is not None
        try:
            prefill = self.prefiller.prefill_request(
                seq.layout, request, out=self.runner.slot_kv(seq.slot, num_tokens), opened=opened
            )
        except Exception as exc:
            log.exception("prefill failed")
            self.post.fail(seq, exc)
            return
        prefill.prefill_s = time.perf_counter() - seq.scheduled_s
        seq.prefill, seq.num_cached = prefill, num_tokens
        self.chunks.write_back(prefill.missing_chunks)
        # Penalised tokens are no greedy continuation that the shadow's full prefill could match.
        seq.shadow = self.shadow.sample(
            request.mode,
            seq.layout.token_ids,
            request.temperature == 0.0 and seq.penalties.neutral,
            prefill.blend.fell_back_to_full_prefill,
            (prefill.output.keys, prefill.output.values),
        )
        logits = prefill.output.logits
        if not seq.penalties.neutral:
            self.runner.penalties.start(seq.slot, seq.layout.token_ids)
        self.post.accept(seq, self.post.penalised([seq], logits[None])[0], logits)

    def decode(self, seqs: list[Job]) -> int:
        """One token for every sequence, as one batch; the tokens fed."""
        try:
            logits = self.runner.decode(
                [s.slot for s in seqs],  # type: ignore[misc]
                [s.num_cached for s in seqs],
                [s.next_token for s in seqs],  # type: ignore[misc]
            )
        except Exception as exc:
            log.exception("decode step failed")
            for seq in seqs:
                self.post.fail(seq, exc)
            return len(seqs)
        penalised = self.post.penalised(seqs, logits)
        for seq, row, raw in zip(seqs, penalised, logits, strict=True):
            seq.num_cached += 1
            self.post.accept(seq, row, raw)
        return len(seqs)
