"""Oracle drafts: the target's own greedy continuation of each request's current prefix.

Plugged into a DSpark proposer by the test harness (``tests/support/draft_hooks.py``), these drafts are what a
perfect draft model would propose, so the verify path accepts whole blocks even with the
tiny checkpoint's random draft weights. They are derived from the run itself: the hook
rebuilds each request's committed tokens (prompt, then every anchor and the drafts the
target accepted before it) and asks the plain target to continue exactly that prefix. A
continuation computed in another process can differ at a bf16 near-tie; then the run's
anchor departs from the cached continuation and the continuation is recomputed from the
run's prefix, so one near-tie never derails the rest of the run.
"""

from __future__ import annotations

from collections.abc import Callable

from scripts.verify.plain_target import PlainTarget

# (call index, row in the call, continuation) -> the drafts actually handed to vLLM.
Corrupt = Callable[[int, int, list[int]], list[int]]


def external_id(req_id: str) -> str:
    """The id a request was added with (vLLM appends ``-<suffix>`` internally)."""
    return req_id.rsplit("-", 1)[0]


class OracleDrafts:
    """A draft hook drafting the plain target's greedy continuation."""

    def __init__(
        self,
        target: PlainTarget,
        prompts: dict[str, list[int]],
        horizon: int,
        corrupt: Corrupt | None = None,
    ):
        self.target = target
        self.prompts = prompts
        self.horizon = horizon  # tokens continued per target call (>= max_tokens + N)
        self.corrupt = corrupt
        self.committed: dict[str, list[int]] = {}  # run's tokens up to the latest anchor
        self.sent: dict[str, list[int]] = {}  # drafts handed to vLLM at the latest anchor
        self.calls = 0
        self.recomputed = 0  # continuations recomputed because the run left the cached one
        # One batched call up front: later calls happen only where the run leaves these.
        conts = target.greedy(list(prompts.values()), horizon)
        # known[rid]: a prefix of the run + the target's greedy continuation of that prefix.
        self.known = {rid: p + c for (rid, p), c in zip(prompts.items(), conts, strict=True)}

    def _commit(self, rid: str, pos: int, token: int) -> list[int]:
        """The run's tokens at positions ``0..pos`` (inclusive), ``token`` at ``pos``."""
        prompt = self.prompts[rid]
        prev = self.committed.get(rid, [])
        drafts = self.sent.get(rid, [])
        seq = []
        for q in range(pos):
            if q < len(prompt):
                seq.append(prompt[q])
            elif q < len(prev):
                seq.append(prev[q])
            elif q - len(prev) < len(drafts):  # accepted drafts sit right after the anchor
                seq.append(drafts[q - len(prev)])
            else:
                raise RuntimeError(
                    f"{rid}: anchor at position {pos} skips position {q}, which was neither "
                    f"prompt, committed nor drafted"
                )
        if pos < len(prompt) and token != prompt[pos]:
            raise RuntimeError(f"{rid}: anchor token {token} at prompt position {pos} != prompt")
        seq.append(token)
        self.committed[rid] = seq
        return seq

    def __call__(self, *, req_ids, anchor_positions, anchor_tokens, drafts):
        n = drafts.shape[1]
        rows = []
        for i, req_id in enumerate(req_ids):
            rid = external_id(req_id)
            pos = int(anchor_positions[i])
            rows.append((rid, self._commit(rid, pos, int(anchor_tokens[i]))))
        # A request still in its prompt is continued from its whole prompt (its drafts are
        # discarded until the prompt is done; the continuation then serves its decode).
        keys = {rid: max(seq, self.prompts[rid], key=len) for rid, seq in rows}
        stale = {
            rid: key
            for (rid, seq), key in zip(rows, keys.values(), strict=True)
            if self.known.get(rid, [])[: len(key)] != key or len(self.known[rid]) < len(seq) + n
        }
        if stale:
            self.recomputed += sum(
                rid in self.known and self.known[rid][: len(key)] != key
                for rid, key in stale.items()
            )
            conts = self.target.greedy(list(stale.values()), self.horizon)
            for (rid, key), cont in zip(stale.items(), conts, strict=True):
                self.known[rid] = key + cont
        out = drafts.clone()
        for i, (rid, seq) in enumerate(rows):
            cont = self.known[rid][len(seq) : len(seq) + n]
            if self.corrupt is not None:
                cont = self.corrupt(self.calls, i, list(cont))
            self.sent[rid] = cont
            out[i] = out.new_tensor(cont)
        self.calls += 1
        return out
