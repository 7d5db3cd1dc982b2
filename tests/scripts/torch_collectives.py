"""Every torch.distributed call on backend "dsml", checked against values every rank can
compute (started by `dsml run` or torchrun). Prints "ok" on success. With the argument
"cuda", every tensor is on GPU `LOCAL_RANK % count` (through cupy; no bfloat16 there)."""

import os
import sys

import torch
import torch.distributed as dist

import dsml.torch  # noqa: F401 (registers the backend)

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.uint8]
if sys.argv[1:] == ["cuda"]:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.set_default_device("cuda")  # every tensor below, results and outputs included
    DTYPES.remove(torch.bfloat16)  # cupy has no bfloat16: refused with a ConfigError


def value(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(n) + rank) % 5).to(dtype)


def strided(t: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(t.numel() * 2, dtype=t.dtype)
    wide[::2] = t
    return wide[::2]


def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert torch.equal(got, want), (what, got, want)


dist.init_process_group("dsml")
rank, size = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "dsml"
for dtype in DTYPES:
    for layout in (lambda t: t, strided):
        n = 2 * size
        mine = value(rank, n, dtype)
        total = sum(value(r, n, torch.float64) for r in range(size)).to(dtype)

        t = layout(mine.clone())
        dist.all_reduce(t)
        check(f"all_reduce {dtype}", t, total)

        if not dtype.is_floating_point:  # bitwise ops, as gloo has them
            for op, fold in (
                (dist.ReduceOp.BAND, torch.bitwise_and),
                (dist.ReduceOp.BOR, torch.bitwise_or),
                (dist.ReduceOp.BXOR, torch.bitwise_xor),
            ):
                want = value(0, n, dtype)
                for r in range(1, size):
                    want = fold(want, value(r, n, dtype))
                t = layout(mine.clone())
                dist.all_reduce(t, op=op)
                check(f"all_reduce {op} {dtype}", t, want)

        work = dist.all_reduce(layout(mine.clone()), op=dist.ReduceOp.MAX, async_op=True)
        work.wait()
        fut = dist.all_reduce(layout(mine.clone()), async_op=True).get_future()
        check("all_reduce future", fut.wait()[0], total)

        t = layout(mine.clone())
        dist.broadcast(t, src=size - 1)
        check("broadcast", t, value(size - 1, n, dtype))

        t = layout(mine.clone())
        dist.reduce(t, dst=0)
        check("reduce", t, total if rank == 0 else mine)

        outs = [torch.zeros(n, dtype=dtype) for _ in range(size)]
        dist.all_gather(outs, layout(mine.clone()))
        for r in range(size):
            check("all_gather", outs[r], value(r, n, dtype))

        out = torch.zeros(n * size, dtype=dtype)
        dist.all_gather_into_tensor(out, layout(mine.clone()))
        check("all_gather_into_tensor", out, torch.cat([value(r, n, dtype) for r in range(size)]))

        outs = [torch.zeros(n, dtype=dtype) for _ in range(size)] if rank == 0 else None
        dist.gather(layout(mine.clone()), outs, dst=0)
        if rank == 0:
            for r in range(size):
                check("gather", outs[r], value(r, n, dtype))

        out = torch.zeros(2, dtype=dtype)
        parts = [value(10 * r, 2, dtype) for r in range(size)] if rank == 0 else None
        dist.scatter(out, parts, src=0)
        check("scatter", out, value(10 * rank, 2, dtype))

        out = torch.zeros(2, dtype=dtype)
        dist.reduce_scatter(out, [value(rank + j, 2, dtype) for j in range(size)])
        check(
            "reduce_scatter",
            out,
            sum(value(r + rank, 2, torch.float64) for r in range(size)).to(dtype),
        )

        out = torch.zeros(2, dtype=dtype)
        dist.reduce_scatter_tensor(out, layout(mine.clone()))
        check("reduce_scatter_tensor", out, total[2 * rank : 2 * rank + 2])

        out = torch.zeros(n, dtype=dtype)
        dist.all_to_all_single(out, layout(mine.clone()))
        want = torch.cat([value(r, n, dtype)[2 * rank : 2 * rank + 2] for r in range(size)])
        check("all_to_all_single", out, want)

        # uneven: rank r sends j + 1 elements to rank j
        ins = list(
            torch.split(value(rank, sum(range(1, size + 1)), dtype), list(range(1, size + 1)))
        )
        outs = [torch.zeros(rank + 1, dtype=dtype) for _ in range(size)]
        dist.all_to_all(outs, ins)
        for r in range(size):
            start = sum(range(1, rank + 1))
            check(
                "all_to_all uneven",
                outs[r],
                value(r, sum(range(1, size + 1)), dtype)[start : start + rank + 1],
            )

        if size > 1:
            right, left = (rank + 1) % size, (rank - 1) % size
            req = dist.isend(layout(mine.clone()), right, tag=3)
            got = torch.zeros(n, dtype=dtype)
            dist.recv(got, left, tag=3)
            req.wait()
            check("send/recv", got, value(left, n, dtype))

dist.barrier()
sub = dist.new_group(list(range(size)), backend="dsml")
t = torch.ones(3)
dist.all_reduce(t, group=sub)
check("new_group all_reduce", t, torch.full((3,), float(size)))
dist.destroy_process_group()
os.write(1, b"ok\n")  # one write: ranks share stdout under torchrun
