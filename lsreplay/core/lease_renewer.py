"""The process that holds a run's S3 lease for lsreplay.core.run_lock: it takes the lease, renews
it and lets it go on an interpreter of its own, so that nothing the run's process computes (one
`**` on huge integers holds that process's GIL for minutes) delays a renewal.

    python -m lsreplay.core.lease_renewer      (started by run_lock; one JSON line a message)

Its first line on stdin is {"uri", "options", "lease"}: the store (options hold credentials,
so never on the command line) and the lease's life in seconds. Then requests, each with an id
that its answer carries back:

- {"acquire": holder}: create the lease (If-None-Match: *), or take over one unrenewed for its
  life (a PUT on the ETag read) -> {"acquired": sent, "took_over": the former holder or null},
  or {"held": the holder's record, "age": seconds since its last renewal};
- {"renew": true}: renew now -> {"renewed": sent}, {"lost": why} or {"failed": why};
- {"release": true}: delete the lease if it is still this holder's (If-Match) -> {"released":
  true} or {"failed": why}; then it exits.

Between requests it renews the lease it holds every life / 3, writing {"renewed": sent},
{"failed": why} (a renewal that could not reach the store) or {"lost": why} (another process
took it over: it renews no more). `sent` is when the renewal left, on `lease_clock`: the lease
holds until at least sent + its life by the server's clock. When stdin closes (the run's
process ended or was killed) it exits without releasing: the lease runs out after its life.
"""

from __future__ import annotations

import json
import os
import select
import sys
from dataclasses import asdict

from lsreplay.core.run_lock import LOCK_KEY, Holder, lease_clock
from lsreplay.core.storage import Contended, MissingEntry, StorageError, Store


class Renewer:
    def __init__(self, store: Store, lease: float):
        self.store, self.lease = store, lease
        self.holder: Holder | None = None
        self.etag: str | None = None  # of the lease this process holds
        self.due = float("inf")  # when the next renewal is due

    def acquire(self, holder: Holder) -> dict:
        while True:
            sent = lease_clock()
            try:
                self.etag = self.store.write_if(LOCK_KEY, holder.encode(), None)
                return self._took(holder, sent, None)
            except Contended:
                pass
            try:
                data, etag, age = self.store.read_versioned(LOCK_KEY)
            except MissingEntry:  # released meanwhile: try again
                continue
            if age <= self.lease:
                return {"held": data.decode(errors="replace"), "age": age}
            sent = lease_clock()
            try:  # a lease its holder stopped renewing: taken over, unless another process was first
                self.etag = self.store.write_if(LOCK_KEY, holder.encode(), etag)
            except Contended:
                continue
            former = Holder.parse(data)
            return self._took(holder, sent, f"{former.describe() if former else 'a writer not of lsreplay'}, not "
                                            f"renewed for {age:.0f} s")

    def _took(self, holder: Holder, sent: float, former: str | None) -> dict:
        self.holder, self.due = holder, sent + self.lease / 3
        return {"acquired": sent, "took_over": former}

    def renew(self) -> dict:
        self.holder = Holder(**{**asdict(self.holder), "renewals": self.holder.renewals + 1})
        sent = lease_clock()
        try:
            self.etag = self.store.write_if(LOCK_KEY, self.holder.encode(), self.etag)
        except Contended:
            self.holder, self.due = None, float("inf")
            return {"lost": "another process took the run's lease over"}
        except StorageError as e:
            self.due = lease_clock() + self.lease / 10  # soon again: the lease runs out meanwhile
            return {"failed": str(e)}
        self.due = sent + self.lease / 3
        return {"renewed": sent}

    def release(self) -> dict:
        if self.holder is None:
            return {"released": False}
        try:
            self.store.delete_if(LOCK_KEY, self.etag)
        except StorageError as e:  # taken over meanwhile, or unreachable: it runs out
            return {"failed": str(e)}
        return {"released": True}


def serve() -> None:
    incoming = os.fdopen(0, "rb", buffering=0)
    first = json.loads(_line(incoming))
    renewer = Renewer(Store(first["uri"], first["options"]), first["lease"])
    pending = b""
    while True:
        wait = max(0.0, renewer.due - lease_clock()) if renewer.due != float("inf") else None
        if select.select([incoming], [], [], wait)[0]:
            chunk = incoming.read(1 << 16)
            if not chunk:  # the run's process is gone: the lease runs out
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if "acquire" in request:
                    try:
                        answer = renewer.acquire(Holder(**request["acquire"]))
                    except StorageError as e:  # the store cannot be reached: the process asking says so
                        answer = {"failed": str(e)}
                elif "renew" in request:
                    answer = renewer.renew() if renewer.holder is not None else {"lost": "it holds no lease"}
                else:
                    _write({"reply": request["id"], **renewer.release()})
                    return
                _write({"reply": request["id"], **answer})
        elif renewer.holder is not None and lease_clock() >= renewer.due:
            _write(renewer.renew())


def _line(stream) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = stream.read(1)
        if not chunk:
            sys.exit(0)
        data += chunk
    return data


def _write(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    serve()
