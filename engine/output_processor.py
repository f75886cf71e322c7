"""The postprocess side of the engine loop: sampled tokens become request outputs.

`OutputProcessor` appends each step's sampled tokens to their requests, applies the stop
conditions (stop ids, stop strings, max_tokens and the context limit), detokenizes
incrementally into stream deltas, and keeps the groups of a request's n samples until their
`RequestOutput` is read. Ending a request is reported to the engine through `on_finish`, which
frees its pages. The common row (a token that cannot end its request, no text to detokenize)
is appended with no per-token check: one numpy test over the whole step finds the rows that
may stop (`_rows_that_may_stop`).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from engine.detokenizer import IncrementalDetokenizer
from engine.engine_types import InFlight, StreamDelta
from engine.request import (CompletionOutput, FinishReason, Request, RequestOutput,
                            SamplingParams, logprob_entry)

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def stop_ids_of(params: SamplingParams, eos_token_ids: Sequence[int],
                vocab_size: int | None = None) -> frozenset[int]:
    """The token ids that end a request: its stop_token_ids, and the model's EOS ids unless
    ignore_eos. Raises ValueError for a stop id that is not an integer fitting int64, or (given
    `vocab_size`) that lies outside the vocabulary: such an id could never be sampled."""
    for token in params.stop_token_ids:
        if (not isinstance(token, (int, np.integer)) or isinstance(token, bool)
                or not INT64_MIN <= token <= INT64_MAX):
            raise ValueError(f"stop_token_ids must be integer token ids that fit in int64, "
                             f"got {token!r}")
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise ValueError(f"stop_token_ids must be token ids in the vocabulary "
                             f"[0, {vocab_size}), got {token!r}")
    return frozenset(int(t) for t in params.stop_token_ids).union(
        () if params.ignore_eos else eos_token_ids)


def stop_reason(request: Request, token: int, limit: int) -> FinishReason | None:
    """Whether `token`, just appended to the request's outputs, ends it (a stop id, or
    max_tokens or the context `limit` reached)."""
    if token in request.stop_ids:
        return FinishReason.STOP
    # Request.length_room(limit) <= 0, inlined: this runs for every token.
    num_outputs = len(request.output_ids)
    if num_outputs >= request.params.max_tokens or len(request.prompt_ids) + num_outputs >= limit:
        return FinishReason.LENGTH
    return None


class OutputProcessor:
    """Owns the request groups, their detokenizers and the stop ids of every request added.

    on_finish(request, reason): called when an appended token, a stop string or an abort ends
    a request (its finish_reason is set, its finish_time not yet); the engine frees its pages
    there.
    The `limit` argument of the append methods is the context limit of the step (the engine's
    `_context_limit`, computed once per step)."""

    def __init__(self, tokenizer, on_finish: Callable[[Request, FinishReason], None]):
        self.tokenizer = tokenizer
        self._on_finish = on_finish
        self._groups: dict[int, list[Request]] = {}
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._finished_groups: list[int] = []
        # Every stop id of every request added (only grows): appends look for these in the
        # tokens (_rows_that_may_stop), as a set and as an array.
        self._any_stop_ids: frozenset[int] = frozenset()
        self._any_stop_array = np.zeros(0, np.int64)

    # ---- groups -------------------------------------------------------------------------------

    def add(self, group_id: int, requests: list[Request]) -> None:
        """Registers a request's samples (their stop_ids from `stop_ids_of`); with a tokenizer,
        each gets an incremental detokenizer."""
        for request in requests:
            if not request.stop_ids <= self._any_stop_ids:
                self._any_stop_ids |= request.stop_ids
                self._any_stop_array = np.fromiter(self._any_stop_ids, np.int64)
            if self.tokenizer is not None:
                self._detokenizers[request.request_id] = IncrementalDetokenizer(
                    self.tokenizer, request.params.stop)
        self._groups[group_id] = requests

    def abort(self, group_id: int, now: float) -> None:
        """Ends the unfinished samples of a group (ABORT) and reports the group as finished;
        an unknown group is ignored."""
        samples = self._groups.get(group_id)
        if samples is None:
            return
        for request in samples:
            if not request.finished:
                request.finish_reason = FinishReason.ABORT
                self._on_finish(request, FinishReason.ABORT)
                request.finish_time = now
        if group_id not in self._finished_groups:
            self._finished_groups.append(group_id)

    def finished_request_ids(self) -> list[int]:
        """Ids of groups finished (or aborted) since the last call (the list is cleared)."""
        done, self._finished_groups = self._finished_groups, []
        return done

    def output_of(self, group_id: int, release: bool = True) -> RequestOutput:
        """The output of a finished group; with `release`, it is forgotten."""
        samples = self._groups[group_id]
        outputs = []
        for index, r in enumerate(samples):
            detokenizer = self._detokenizers.get(r.request_id)
            text = detokenizer.text if detokenizer is not None else ""
            outputs.append(CompletionOutput(index, list(r.output_ids), text, r.finish_reason,
                                            list(r.output_logprobs)))
        first = samples[0]
        first_token = min((r.first_token_time for r in samples if r.first_token_time),
                          default=first.finish_time)
        finish = max(r.finish_time or first_token for r in samples)
        result = RequestOutput(group_id, first.prompt_ids, outputs,
                               first_token - first.arrival_time, finish - first.arrival_time,
                               sum(r.num_prefix_hit_tokens for r in samples))
        if release:
            for r in samples:
                self._detokenizers.pop(r.request_id, None)
            del self._groups[group_id]
        return result

    # ---- appending sampled tokens -----------------------------------------------------------

    def append_step(self, flight: InFlight, samples: tuple, now: float,
                    limit: int) -> tuple[list[StreamDelta], int]:
        """Appends a launched step's samples (host arrays: tokens, chosen logprobs, top ids,
        top logprobs) to its requests; returns (their deltas, tokens appended)."""
        tokens, chosen, top_ids, top_logprobs = samples
        deltas = []
        detokenizers = self._detokenizers
        requests = flight.requests
        may_stop_rows = self._rows_that_may_stop(flight, tokens[: len(requests), None])
        for i, (request, complete, token, may_stop) in enumerate(zip(
                requests, flight.completes, tokens.tolist(), may_stop_rows)):
            if not complete:
                continue  # a prefill chunk short of the prompt's end
            request.num_pending -= 1
            if request.finish_reason is not None:
                continue  # ended or aborted while this step ran: the token is dropped
            if (not may_stop and chosen is None and request.first_token_time is not None
                    and request.request_id not in detokenizers):
                # The common case inlined (a decode token that does not stop the request,
                # no logprobs, no text, not the first): append it.
                request.output_ids.append(token)
                deltas.append(StreamDelta(request.group_id, request.sample_index, "",
                                          [token], None, None))
                continue
            logprob = (None if chosen is None else
                       logprob_entry(request, i, chosen, top_ids, top_logprobs))
            deltas.append(self.append(request, [token], logprob, now, limit))
        return deltas, len(deltas)  # one token each

    def append_round(self, flight: InFlight, tokens: np.ndarray, now: float,
                     limit: int) -> tuple[list[StreamDelta], int]:
        """Appends a round's tokens [steps, bucket(S)] to its requests, each up to its stop
        condition (a request that stopped inside the round drops the rest); returns (the
        deltas, tokens appended). A row none of whose tokens can end its request (no stop id
        of any request among them, max_tokens and the context not reached: InFlight.may_end),
        that does not bring its first token and has no text to detokenize is appended whole;
        the others token by token (`append`)."""
        steps = flight.steps
        requests = flight.requests
        block = tokens[:, : len(requests)].T  # [S, steps]
        detokenizers = self._detokenizers
        deltas = []
        slow_rows = slow_tokens = 0  # rows appended token by token, and their tokens
        for r, row, special, complete in zip(requests, block.tolist(),
                                             self._rows_that_may_stop(flight, block),
                                             flight.completes):
            if not complete:
                continue  # a mixed round's prefill chunk short of the prompt's end
            r.num_pending -= steps
            if r.finish_reason is not None:
                continue  # ended or aborted while the round ran: its tokens are dropped
            if special or (detokenizers and r.request_id in detokenizers):
                deltas.append(self.append(r, row, None, now, limit))
                slow_rows += 1
                slow_tokens += len(deltas[-1].token_ids)
            else:
                r.output_ids += row
                deltas.append(StreamDelta(r.group_id, r.sample_index, "", row, None, None))
        return deltas, steps * (len(deltas) - slow_rows) + slow_tokens

    def append_each(self, requests: list[Request], new_tokens: list[list[int]], logprobs: tuple,
                    now: float, limit: int) -> tuple[list[StreamDelta], int]:
        """Appends to each request its own list of new tokens (a speculative round's accepted
        tokens; a request with none is skipped); logprobs: (chosen, top ids, top logprobs) per
        row, or Nones. Returns (the deltas, tokens appended)."""
        deltas = []
        for i, (request, tokens) in enumerate(zip(requests, new_tokens)):
            if not tokens:
                continue
            logprob = logprob_entry(request, i, *logprobs)
            deltas.append(self.append(request, tokens, logprob, now, limit))
        return deltas, sum(len(d.token_ids) for d in deltas)

    def _rows_that_may_stop(self, flight: InFlight, block: np.ndarray) -> list[bool]:
        """Per row of a launched step or round (block: its tokens [S, k]), whether they may
        end its request: a stop id of any request (a superset of the row's own) among them, or
        the length or its first token (InFlight.may_end). The other rows are appended whole,
        with no stop check."""
        return (flight.may_end | np.isin(block, self._any_stop_array).any(axis=1)).tolist()

    def append(self, request: Request, new_tokens: list[int], logprob, now: float,
               limit: int) -> StreamDelta:
        """Appends a step's tokens to a request, stopping early at a stop condition; returns
        its delta (the tokens kept, new text, the finish reason if it ended)."""
        if logprob is not None:
            request.output_logprobs.append(logprob)
        if request.first_token_time is None:
            request.first_token_time = now
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is None and len(new_tokens) == 1:  # a decode step without text
            request.output_ids.append(new_tokens[0])
            reason = stop_reason(request, new_tokens[0], limit)
            text, appended = "", new_tokens
        elif detokenizer is None:  # several tokens without text: cut at the first that ends it
            # (what stop_reason decides token by token: a stop id before the length)
            stop_ids = request.stop_ids
            at_stop = next((j for j, token in enumerate(new_tokens) if token in stop_ids), None)
            num_outputs = len(request.output_ids)
            at_length = max(min(request.params.max_tokens - num_outputs,  # length_room - 1
                                limit - len(request.prompt_ids) - num_outputs) - 1, 0)
            if at_stop is not None and at_stop <= at_length:
                end, reason = at_stop, FinishReason.STOP
            elif at_length < len(new_tokens):
                end, reason = at_length, FinishReason.LENGTH
            else:
                end, reason = None, None
            appended = new_tokens if end is None else new_tokens[: end + 1]
            request.output_ids += appended
            text = ""
        else:
            reason, text, appended = None, "", []
            for token in new_tokens:
                request.output_ids.append(token)
                appended.append(token)
                reason = stop_reason(request, token, limit)
                text += detokenizer.add(request.output_ids, reason is not None)
                if reason is None and detokenizer.stopped_at is not None:
                    reason = FinishReason.STOP
                if reason is not None:
                    break
        group_id = request.group_id
        if reason is not None:
            request.finish_reason = reason
            self._on_finish(request, reason)
            request.finish_time = now
            if all(r.finished for r in self._groups[group_id]):
                self._finished_groups.append(group_id)
        return StreamDelta(group_id, request.sample_index, text, appended, reason,
                           None if logprob is None else [logprob])
