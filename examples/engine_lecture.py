"""The lecture's engine program, A = 2; B = allreduce(A); D = A * B, on every rank.

    dsml run -n 4 examples/engine_lecture.py

Each statement is pushed into the dependency engine with the vars it reads and mutates;
the all_reduce also mutates `comm.var`, so collectives are issued in push order on every
rank while independent work (here: C = A + 1) runs beside them.
"""

import asyncio

import numpy as np

import dsml


async def main() -> None:
    async with dsml.init() as comm:
        engine = comm.engine
        A = engine.tag("A", np.zeros(4))
        B = engine.tag("B", np.zeros(4))
        C = engine.tag("C", np.zeros(4))
        D = engine.tag("D", np.zeros(4))

        def set_a() -> None:  # A = 2 (times the rank + 1, so the sum says who took part)
            A.data[:] = 2 * (comm.rank + 1)

        def copy_a_to_b() -> None:
            B.data[:] = A.data

        def c_is_a_plus_1() -> None:  # independent of the all_reduce: overlaps it
            C.data[:] = A.data + 1

        def d_is_a_times_b() -> None:
            D.data[:] = A.data * B.data

        engine.push(set_a, mutate=[A.var])
        engine.push(copy_a_to_b, read=[A.var], mutate=[B.var])
        comm.push_all_reduce(B)  # B = allreduce(A): mutate=[B.var, comm.var]
        engine.push(c_is_a_plus_1, read=[A.var], mutate=[C.var])
        engine.push(d_is_a_times_b, read=[A.var, B.var], mutate=[D.var])
        await engine.wait_all()

        expected_b = 2 * sum(r + 1 for r in range(comm.world_size))
        assert (B.data == expected_b).all()
        assert (D.data == A.data * expected_b).all()
        print(
            f"rank {comm.rank}: A={A.data[0]:g} B=allreduce(A)={B.data[0]:g} "
            f"C=A+1={C.data[0]:g} D=A*B={D.data[0]:g}   {engine!r}"
        )


if __name__ == "__main__":
    asyncio.run(main())
