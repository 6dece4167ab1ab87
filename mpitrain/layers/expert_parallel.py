"""Expert parallelism: the experts of an MoE layer live on the ranks of the ep group; tokens travel to them and back.

The ep group comes from the experts' own mesh (comm/mesh.py, etp x ep x edp over the ranks of a pipeline stage):
ep consecutive holders of other tokens (tp shares, cp ranks, dp ranks) form one group, each holding E/ep consecutive
experts (rank r: experts r*E/ep ... (r+1)*E/ep - 1), and `expert_dp` joins the ranks that hold the same expert pieces,
over which the experts' gradients are summed. Every rank routes its own tokens: a cp rank its chunks of the
sequences (MoE is per token, so they are just more tokens to the experts), and with etp = 1 < tp each tp rank its
share of the tokens the tp ranks all hold. With etp = tp each expert is split over the tp group like the dense MLP.

One exchange, used four times per MoE layer and micro-batch (forward: dispatch, combine; backward: the gradients
the other way round):

    dispatch   rows sorted by global expert  -> rows of this rank's experts, grouped by local expert (expert-major)
    combine    expert-major rows              -> back to their senders, in the order the sender dispatched them

Each is one all_to_allv of the rows (counted under "all_to_all": exactly the routed rows that go to other ranks).
Before it, the ranks learn how many rows each sends to each expert with one small all_gather of E counts per rank
(counted under "all_gather", so the all_to_all counter holds token bytes only). With one rank both are local copies.

FP8 dispatch (`model.moe.dispatch_dtype = "fp8"`, DeepSeek-V3's): the forward dispatch sends each row as e4m3 codes
with one fp32 scale per 1x128 tile of it (the tile's amax / 448; layers/fp8.quantize_blocks, which clips to 448
before the cast, since an out-of-range e4m3fn cast gives NaN), two all_to_allv (codes, scales): a bf16 row's bytes
halved, plus 4 per tile (`dispatch_bytes`). The experts compute with the decoded rows. Every dispatched row is
quantized, also those that stay on this rank, so a layout's numbers do not depend on which experts are local (ep 2
matches one process). The combine and the backward's exchanges stay in the compute dtype, as in DeepSeek-V3: the
combine sums the top-k expert outputs of a token weighted by its gates, and an e4m3 error of each output would
enter the residual stream directly, where the dispatch's error is damped by the expert's nonlinearity and only
perturbs the input of one linear (the input gradient of the dispatch passes straight through the rounding).
"""
from __future__ import annotations

import math

import numpy as np

from mpitrain.backend import array_module, to_host, wire_view
from mpitrain.layers.fp8 import FORMATS, Quantized, quantize_blocks

DISPATCH_TILE = 128  # fp8 dispatch: one fp32 scale per 1x128 tile of a row (DeepSeek-V3)
SCALE_BYTES = 4


def dispatch_bytes(rows: int, width: int, itemsize: int, dispatch_dtype: str = "same") -> int:
    """Bytes of `rows` dispatched rows of `width` values (compute dtype of `itemsize` bytes) on the wire: the rows
    themselves, or with fp8 one byte a value plus an fp32 scale per 1x128 tile."""
    if dispatch_dtype == "fp8":
        return rows * (width + SCALE_BYTES * math.ceil(width / DISPATCH_TILE))
    return rows * width * itemsize


class ExpertParallel:
    """The ep group (None: one rank) and where each of `experts` experts lives. `size` without a group: only the
    shapes of rank 0's pieces are wanted (mpitrain memory)."""

    def __init__(self, group=None, experts: int = 1, size: int | None = None, etp=None, etp_size: int | None = None,
                 tokens=None, share: tuple[int, int] = (0, 1)):
        self.group = group
        self.size = group.size if group is not None else (size or 1)
        self.rank = group.rank if group is not None else 0
        if experts % self.size:
            raise ValueError(f"{experts} experts do not split over {self.size} expert-parallel ranks")
        self.experts, self.local = experts, experts // self.size
        self.first = self.rank * self.local  # global index of this rank's first expert
        self.etp = etp  # the group each expert's width is split over (the tp group when etp = tp), or None
        self.etp_size = etp.size if etp is not None else (etp_size or 1)
        self.etp_rank = etp.rank if etp is not None else 0
        self.tokens = tokens  # the group one micro-batch's tokens are split over (cp), or None
        self.share, self.shares = share  # etp = 1 < tp: which of the tp ranks' equal shares of the tokens is ours

    @classmethod
    def of_mesh(cls, mesh, experts: int) -> ExpertParallel:
        """This rank's place on the mesh's expert mesh (`parallel.etp`: 1 or tp)."""
        d = mesh.degrees
        whole = d.expert_tp == 1 < d.tp  # whole experts: each tp rank routes its share of the tokens
        return cls(mesh.ep, experts, etp=None if whole else mesh.tp, tokens=mesh.cp if d.cp > 1 else None,
                   share=(mesh.tp_rank, d.tp) if whole else (0, 1))

    @property
    def folded(self) -> bool:
        """Whether the experts' gradients are summed over their own group (expert_dp), not the dense tensors'."""
        return self.size > 1 or self.shares > 1

    def my_picks(self, token, n: int):
        """Which picks (by their token, of n) this rank sends to the experts: all, or its share's."""
        if self.shares == 1:
            return slice(None)
        return np.flatnonzero(token * self.shares // n == self.share)

    def token_sums(self, values: np.ndarray) -> np.ndarray:
        """Sums over the ranks that split one micro-batch's tokens (cp): the routing statistics of the whole
        micro-batch, which the auxiliary loss needs (it is not a sum over tokens of per-token terms)."""
        values = np.ascontiguousarray(values, dtype=np.float64)
        if self.tokens is not None:
            self.tokens.all_reduce(values)
        return values

    def __repr__(self) -> str:
        return f"ExpertParallel(rank {self.rank} of {self.size}, experts {self.first}..{self.first + self.local - 1})"

    def route(self, rows_per_expert) -> Routing:
        """rows_per_expert: (E,) how many rows this rank sends to each global expert. Every rank's counts are
        gathered, so each knows what it receives from whom."""
        mine = np.ascontiguousarray(np.asarray(to_host(rows_per_expert), dtype=np.int64))
        everyone = np.empty(self.size * self.experts, np.int64)
        if self.group is None:
            everyone[...] = mine
        else:
            self.group.all_gather(mine, everyone)
        everyone = everyone.reshape(self.size, self.size, self.local)  # [sender, owner rank, local expert]
        return Routing(sent=everyone[self.rank], received=everyone[:, self.rank])

    def dispatch(self, rows, routing: Routing, dispatch_dtype: str = "same"):
        """rows (A, C) in global-expert order -> (rows of this rank's experts, expert-major). dispatch_dtype "fp8":
        they travel as e4m3 codes and per-tile scales and arrive decoded, in rows' dtype."""
        send_rows, recv_rows = routing.sent.sum(axis=1), routing.received.sum(axis=1)
        if dispatch_dtype == "fp8":
            received = self._exchange_fp8(rows, send_rows, recv_rows)
        else:
            received = self._exchange(rows, send_rows, recv_rows)
        return received[routing.to_expert_major] if len(received) else received

    def combine(self, rows, routing: Routing):
        """Expert-major rows (this rank's experts' outputs) -> the senders' rows, in their dispatch order."""
        source_major = rows[routing.to_source_major] if len(rows) else rows
        return self._exchange(source_major, routing.received.sum(axis=1), routing.sent.sum(axis=1))

    def _exchange(self, rows, send_rows, recv_rows):
        xp, width = array_module(rows), rows.shape[1]
        out = np.empty((int(recv_rows.sum()), width), dtype=rows.dtype)
        send = np.ascontiguousarray(to_host(rows))
        if self.group is None:
            out[...] = send
        elif send.dtype == FORMATS["e4m3"]:  # no MPI datatype: its bytes
            self.group.all_to_allv(send.view(np.uint8), send_rows * width, out.view(np.uint8), recv_rows * width)
        else:
            self.group.all_to_allv(wire_view(send), send_rows * width, wire_view(out), recv_rows * width)
        return out if xp is np else xp.asarray(out)

    def _exchange_fp8(self, rows, send_rows, recv_rows):
        """The rows as e4m3 codes with one fp32 scale per 1x128 tile, exchanged, decoded to rows' dtype."""
        xp, host = array_module(rows), to_host(rows)
        wide = host if host.dtype == np.float64 else host.astype(np.float32)  # the scale multiplies in fp32 (fp64)
        tiles = math.ceil(rows.shape[1] / DISPATCH_TILE)
        if len(wide):
            quantized = quantize_blocks(wide, "e4m3", (1, DISPATCH_TILE))
            codes, scales = quantized.codes, quantized.scale_inv
        else:  # nothing to send: every rank still takes part in both exchanges
            codes, scales = np.empty(wide.shape, FORMATS["e4m3"]), np.empty((0, tiles), np.float32)
        codes = self._exchange(codes, send_rows, recv_rows)
        scales = self._exchange(np.ascontiguousarray(scales, dtype=np.float32), send_rows, recv_rows)
        decoded = Quantized(to_host(codes), to_host(scales), (1, DISPATCH_TILE)).dequantize(wide.dtype)
        decoded = decoded.astype(rows.dtype, copy=False)
        return decoded if xp is np else xp.asarray(decoded)


class Routing:
    """Who sends how many rows to which expert, for one exchange. sent[r, e]: rows this rank sends to local expert e
    of rank r; received[s, e]: rows this rank's local expert e gets from rank s. Rows arrive source-major (by
    sender, then expert); the experts want them expert-major (by expert, then sender): the two permutations."""

    def __init__(self, sent, received):
        self.sent, self.received = sent, received
        self.per_local_expert = received.sum(axis=0)  # rows each of this rank's experts processes
        source_start = _starts(received)  # [s, e]: where sender s's rows for expert e start, source-major
        expert_start = _starts(received.T).T  # the same position, expert-major
        self.to_expert_major = np.empty(int(received.sum()), np.int64)
        for (s, e), count in np.ndenumerate(received):
            self.to_expert_major[expert_start[s, e]:expert_start[s, e] + count] = \
                np.arange(source_start[s, e], source_start[s, e] + count)
        self.to_source_major = np.argsort(self.to_expert_major, kind="stable")


def _starts(counts) -> np.ndarray:
    """Start of each block when the blocks of a 2-D count table are laid out row by row."""
    flat = counts.reshape(-1)
    return (np.cumsum(flat) - flat).reshape(counts.shape)
