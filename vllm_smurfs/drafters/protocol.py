"""The messages between a process drafter's client (in the target's worker,
`drafters.process_client.ModelDrafterClient`) and its server (`drafters.process_server`), defined
once.

Messages are pickled named tuples over a local socket (multiprocessing framing; the client reads
and writes it without blocking, see `drafters.channel.Channel`); token sequences are numpy int32
arrays.

Client to server:

    Track([TrackItem(req_id, base, tokens, max_lead), ...])
        keep (or restart) each request's path and draft up to ``max_lead`` tokens past its
        context: the first ``base`` tokens of the context last tracked for ``req_id``, then
        ``tokens`` (a request's text only grows: a track carries what changed)
    Forget([req_id, ...])       drop these requests
    Pause()                     drop every request (each gets a STOP record)
    Shutdown()

Server to client:

    Ready(info)                 the engine is up (pid, vocab_size, load_s, cpus)
    StartFailed(error)          it is not (a traceback)
    Update(taken, records, timings)     after every round: ``taken`` messages acknowledged (the
                                        client bounds what it has in flight), the records of the
                                        round, its engine steps
    StepFailed(taken, error)    the round's engine step raised; the server dropped every request

Records, applied by the client in order (`Record(req_id, kind, payload)`):

    RESET   tokens              the path restarts at ``tokens`` (drafting)
    EXTEND  (start, tokens)     tokens appended at position ``start`` of the path
    RESUME  None                drafting again from the end of the path
    STOP    None                not drafting (paused, no room, or the request failed)
    RESYNC  None                a track built on a context the server no longer has (it dropped
                                the request): the client sends the whole context next time

`Timing(num_reqs, seconds, started)` is one engine step, for the cost model (``started``:
``time.monotonic()`` when it began, so that the client can leave out a step it stopped the
process in the middle of).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

RESET = "reset"
EXTEND = "extend"
RESUME = "resume"
STOP = "stop"
RESYNC = "resync"


class TrackItem(NamedTuple):
    req_id: str
    base: int
    tokens: np.ndarray
    max_lead: int


class Track(NamedTuple):
    items: list[TrackItem]


class Forget(NamedTuple):
    req_ids: list[str]


class Pause(NamedTuple):
    pass


class Shutdown(NamedTuple):
    pass


class Ready(NamedTuple):
    info: dict[str, Any]


class StartFailed(NamedTuple):
    error: str


class Record(NamedTuple):
    req_id: str
    kind: str
    payload: Any


class Timing(NamedTuple):
    num_reqs: int
    seconds: float
    started: float


class Update(NamedTuple):
    taken: int
    records: list[Record]
    timings: list[Timing]


class StepFailed(NamedTuple):
    taken: int
    error: str
