"""The Ray actor's message handling, without Ray: pushes taken in their order whatever order the
calls run in, and the stream yielding what the server sent, in order, as it comes."""

import asyncio

from vllm_smurfs.ray_drafter import RayDrafterActor, _QueueConnection


def _actor() -> RayDrafterActor:
    actor = RayDrafterActor()
    actor._conn = _QueueConnection(asyncio.get_running_loop(), actor._ready)
    return actor


def test_pushes_run_out_of_order_are_taken_in_order():
    async def scenario() -> list[str]:
        actor = _actor()
        for seq in (2, 0, 3, 1, 5):  # as an async actor may run the calls
            await actor.push(seq, f"m{seq}")
        assert actor._conn is not None
        taken = []
        while not actor._conn.inbox.empty():
            taken.append(actor._conn.inbox.get())
        assert actor._early == {5: "m5"}  # waits for message 4
        await actor.push(4, "m4")
        while not actor._conn.inbox.empty():
            taken.append(actor._conn.inbox.get())
        return taken

    assert asyncio.run(scenario()) == ["m0", "m1", "m2", "m3", "m4", "m5"]


def test_the_stream_yields_the_servers_messages_in_order_as_they_come():
    async def scenario() -> list[list[str]]:
        actor = _actor()
        assert actor._conn is not None
        conn = actor._conn
        stream = actor.stream()
        conn.send("a")
        conn.send("b")
        batches = [await stream.__anext__()]  # what was there: one batch
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        assert not waiting.done()  # nothing to send: the stream waits
        # The server's thread sends; the stream wakes.
        await asyncio.to_thread(conn.send, "c")
        batches.append(await asyncio.wait_for(waiting, 1.0))
        return batches

    assert asyncio.run(scenario()) == [["a", "b"], ["c"]]
