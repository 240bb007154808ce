"""Group assembly: scored trajectories in, complete groups out, oldest v_adm first, each traj_id once; a batch is in
admission order, so its layout never depends on the order in which rewards came back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from jetroll.shared.protocol.events import ScoredEvent
from jetroll.shared.protocol.ids import admission_order


@dataclass(slots=True)
class PendingGroup:
    group_id: str
    task: str
    v_adm: int
    group_size: int
    samples: dict[str, tuple[str, ScoredEvent]] = field(default_factory=dict)  # traj_id -> (entry_id, event)

    @property
    def is_complete(self) -> bool:
        return len(self.samples) == self.group_size

    @property
    def entry_ids(self) -> list[str]:
        return [entry_id for entry_id, _ in self.samples.values()]

    @property
    def events(self) -> list[ScoredEvent]:
        return [event for _, event in sorted(self.samples.values(), key=lambda item: item[1].trajectory.sample)]

    @property
    def failed_status(self) -> str | None:
        """The first non-ok final reward status; such a group is dropped whole, never scored as 0."""
        return next((e.status for e in self.events if e.status != "ok"), None)


class GroupBuffer:
    def __init__(self) -> None:
        self.groups: dict[str, PendingGroup] = {}

    def add(self, entry_id: str, event: ScoredEvent) -> bool:
        """Buffer one scored sample; False (caller acks and drops it) for a copy of a traj_id already held."""
        traj = event.trajectory
        group = self.groups.get(traj.group_id)
        if group is None:
            group = self.groups[traj.group_id] = PendingGroup(traj.group_id, traj.task, traj.v_adm, traj.group_size)
        if traj.traj_id in group.samples:
            return False
        group.samples[traj.traj_id] = (entry_id, event)
        return True

    @property
    def num_complete(self) -> int:
        return sum(g.is_complete for g in self.groups.values())

    def has_complete(self, group_ids: frozenset[str]) -> bool:
        return all(g in self.groups and self.groups[g].is_complete for g in group_ids)

    def take_failed(self) -> list[PendingGroup]:
        failed = [g for g in self.groups.values() if g.is_complete and g.failed_status is not None]
        for group in failed:
            del self.groups[group.group_id]
        return failed

    def take_oldest(self, count: int, required: frozenset[str] = frozenset(),
                    quotas: dict[str, int] | None = None) -> list[PendingGroup] | None:
        """`count` complete groups, oldest v_adm first, returned in admission order; or None while fewer are complete or
        while a `required` group (one that must be trained now to stay within eta_hard) is not complete. With per-task
        `quotas`, each task first gets up to its quota of its own oldest groups; what a task leaves unused goes to the
        oldest of the rest, so a slow task never holds a step back and a fast one never crowds the others out."""
        complete = sorted((g for g in self.groups.values() if g.is_complete),
                          key=lambda g: (g.group_id not in required, g.v_adm, admission_order(g.group_id)))
        if len(complete) < count or not self.has_complete(required):
            return None
        taken = [g for g in complete if g.group_id in required][:count]
        if quotas:
            for task, quota in quotas.items():
                own = [g for g in complete if g.task == task and g not in taken]
                taken += own[:max(0, quota - sum(g.task == task for g in taken))][:count - len(taken)]
        taken += [g for g in complete if g not in taken][:count - len(taken)]
        for group in taken:
            del self.groups[group.group_id]
        return sorted(taken, key=lambda g: admission_order(g.group_id))


@dataclass(slots=True)
class TokenBatch:
    """Right-padded sequences; per-token tensors are aligned with the next-token targets. [B, T]"""

    input_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    behavior_logp: torch.Tensor
    v_tok: torch.Tensor
    temperature: torch.Tensor  # [B]
    lengths: torch.Tensor  # [B] input tokens of each row, the rest is padding
    rewards: torch.Tensor  # [G, group_size]
    tasks: list[str]  # per sequence
    pools: list[str]  # per sequence: the rollout pool that generated it
    traj_ids: list[str]  # per sequence
    is_correct: list[bool]  # per sequence


def collate(groups: list[PendingGroup], pad_id: int, device: torch.device | str = "cpu") -> TokenBatch:
    """The groups' samples as right-padded rows, built on the host and moved to `device` once."""
    events = [e for g in groups for e in g.events]
    seqs, rows = [], []
    for scored in events:
        traj = scored.trajectory
        prompt, completion = traj.prompt_ids.numpy(), traj.completion_ids.numpy()
        seqs.append(np.concatenate([prompt, completion]).astype(np.int64))
        rows.append((len(prompt), traj))
    width = max(len(s) for s in seqs) - 1
    num = len(seqs)
    input_ids = np.full((num, width), pad_id, dtype=np.int64)
    targets = np.full((num, width), pad_id, dtype=np.int64)
    loss_mask = np.zeros((num, width), dtype=np.float32)
    behavior = np.zeros((num, width), dtype=np.float32)
    v_tok = np.zeros((num, width), dtype=np.int64)
    for i, (seq, (prompt_len, traj)) in enumerate(zip(seqs, rows, strict=True)):
        length = len(seq) - 1
        input_ids[i, :length] = seq[:-1]
        targets[i, :length] = seq[1:]
        span = slice(prompt_len - 1, length)  # logits at position t predict token t + 1
        loss_mask[i, span] = traj.loss_mask.numpy()
        behavior[i, span] = traj.behavior_logprobs.numpy()
        v_tok[i, span] = traj.v_tok.numpy()

    def on_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    return TokenBatch(
        input_ids=on_device(input_ids), targets=on_device(targets), loss_mask=on_device(loss_mask),
        behavior_logp=on_device(behavior), v_tok=on_device(v_tok),
        temperature=on_device(np.array([e.trajectory.temperature for e in events], dtype=np.float32)),
        lengths=on_device(np.array([len(s) - 1 for s in seqs], dtype=np.int64)),
        rewards=on_device(np.array([[e.reward for e in g.events] for g in groups], dtype=np.float32)),
        tasks=[e.trajectory.task for e in events],
        pools=[e.trajectory.pool for e in events],
        traj_ids=[e.trajectory.traj_id for e in events],
        is_correct=[bool(e.details.get("correct", False)) for e in events],
    )


@dataclass(slots=True)
class PackedGroups:
    """Each group's rows as one sequence: their common prefix once, then each row's own tail. [G, S]

    A tail token sees the prefix and its own row's earlier tokens, at its row's positions, so its logits are those
    of the row layout; `index` [n, W] maps each row-layout position to its flat position in [G * S]."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_mask: torch.Tensor  # [G, S, S]
    index: torch.Tensor


def shared_prefixes(ids: np.ndarray, lens: list[int], group_size: int) -> list[int]:
    """The length of each group's common prefix (its prompt, and any answer tokens all its samples share)."""
    prefixes = []
    for start in range(0, len(ids), group_size):
        shortest = min(lens[start : start + group_size])
        differs = (ids[start : start + group_size, :shortest] != ids[start, :shortest]).any(axis=0).nonzero()[0]
        prefixes.append(int(differs[0]) if len(differs) else shortest)
    return prefixes


def packed_length(input_ids: torch.Tensor, lengths: torch.Tensor, group_size: int) -> int:
    """The sequence length `pack_groups` would give these rows: the longest group's prefix plus all its tails."""
    lens = lengths.tolist()
    prefixes = shared_prefixes(input_ids.cpu().numpy(), lens, group_size)
    return max(sum(lens[g * group_size : (g + 1) * group_size]) - (group_size - 1) * common
               for g, common in enumerate(prefixes))


def pack_groups(input_ids: torch.Tensor, lengths: torch.Tensor, group_size: int, pad_id: int) -> PackedGroups:
    """Pack rows [n, W] (whole groups of `group_size` consecutive rows, `lengths` [n] real tokens each): GRPO's
    samples share their prompt, so the trainer's forward and backward run it once per group, not once per sample."""
    ids, lens = input_ids.cpu().numpy(), lengths.tolist()
    num_rows, width = ids.shape
    index = np.zeros((num_rows, width), dtype=np.int64)
    tokens, positions, owners = [], [], []  # per group; owner -1 is the shared prefix, k the group's k-th row
    for start, common in zip(range(0, num_rows, group_size), shared_prefixes(ids, lens, group_size), strict=True):
        rows = range(start, start + group_size)
        parts, part_positions, part_owners = [ids[start, :common]], [np.arange(common)], [np.full(common, -1)]
        offset = common
        for k, i in enumerate(rows):
            tail = lens[i] - common
            index[i, :common] = np.arange(common)
            index[i, common : lens[i]] = np.arange(offset, offset + tail)
            parts.append(ids[i, common : lens[i]])
            part_positions.append(np.arange(common, lens[i]))
            part_owners.append(np.full(tail, k))
            offset += tail
        tokens.append(np.concatenate(parts))
        positions.append(np.concatenate(part_positions))
        owners.append(np.concatenate(part_owners))
    seq = max(len(t) for t in tokens)
    packed = np.full((len(tokens), seq), pad_id, dtype=np.int64)
    packed_positions = np.zeros((len(tokens), seq), dtype=np.int64)
    owner = np.full((len(tokens), seq), -2, dtype=np.int64)  # padding: sees position 0 only, never seen
    for g, (t, p, o) in enumerate(zip(tokens, positions, owners, strict=True)):
        packed[g, : len(t)], packed_positions[g, : len(t)], owner[g, : len(t)] = t, p, o
        index[g * group_size : (g + 1) * group_size] += g * seq
    is_shared_or_own = (owner[:, None, :] == -1) | (owner[:, None, :] == owner[:, :, None])
    attn_mask = is_shared_or_own & (packed_positions[:, None, :] <= packed_positions[:, :, None])
    device = input_ids.device
    return PackedGroups(*(torch.from_numpy(array).to(device) for array in (packed, packed_positions, attn_mask, index)))
