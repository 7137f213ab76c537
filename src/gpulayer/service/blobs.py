"""Who may read which blob, on a server with auth.

Blobs are content-addressed and shared: one stored copy serves every job
that names its digest. A digest is therefore no right to read a blob: it can
be guessed (the sha256 of a short secret file can be tried in a few
requests). A user may read a blob once the server has seen that user hold
its bytes:

1. they uploaded it, every byte, verified against the digest (also when the
   blob was stored already: see ``http/app.py``);
2. a job of theirs produced it: an output, or a file of a folder output,
   granted when the server accepts the task's result (:meth:`_grant_outputs`),
   before the job is final, so its client can fetch them at once.

A result is a worker's word, so the outputs it names are granted only as
far as the worker proved it holds them: a worker token's own uploads are
kept under :func:`worker_reader` (its ``missing`` answers by them, so it
uploads what it has not proved), and a result names others for no user to
read. A worker registered with an admin's token is trusted with every blob.

Rights are kept per reader (``blob_readers`` in the store) and never taken
back: a user who held the bytes once knows them. Admins read every blob; a
worker fetches what its tasks were given (``may_fetch``).

A job is refused at submit if it names a blob its user may not read (its
bundle, an input, or a file a manifest of either lists): else running it
would read the blob (``cat`` an input), and whether it ran would tell that
the blob exists. The refusal says what it says for a blob not on the server.

Embedded, and on a server without auth, none of this runs: one local user
sees everything.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from .. import bundle
from ..access import Viewer, sees_all
from ..artifacts import ArtifactStore
from ..errors import GPUlayerError, SpecError
from ..jobs import TaskResult
from ..spec import ArtifactRef, JobSpec
from .core import PlaneCore, log
from .state import Running

# What is remembered of the rights in the store (never taken back, so never
# stale), for the submits of a bundle sent before, which ask about every
# file of it: (reader, digest) pairs known readable, about 200 bytes each,
# and (user, manifest) pairs whose every file is. Each emptied when full:
# what was in it costs a store read again.
_READABLE_KEPT = 200_000
_TREES_CHECKED_KEPT = 100_000

# Which reader's blobs a worker's results may name as outputs (see
# keep_blob_readers); None: every blob.
Uploader = Callable[[str], str | None]


def worker_reader(token_digest: str) -> str:
    """The reader under which the blobs a worker token uploaded are kept:
    never a user's name (one starts with a letter or a digit)."""
    return f"~worker:{token_digest}"


class BlobReaders(PlaneCore):
    # Set by keep_blob_readers (a server with auth). None: no rights are
    # kept, nor needed.
    _outputs_from: ArtifactStore | None = None
    _uploader: Uploader | None = None
    _readable_known: set[tuple[str, str]] | None = None
    _trees_checked: set[tuple[str, str]] | None = None

    def keep_blob_readers(self, artifacts: ArtifactStore, uploader: Uploader) -> None:
        """Grant each job's user its outputs as its tasks' results come,
        reading folder outputs' manifests from ``artifacts``. ``uploader``:
        for a worker's id, the reader whose blobs its results may name (see
        :func:`worker_reader`), or None if it is trusted with every blob."""
        self._outputs_from, self._uploader = artifacts, uploader
        self._readable_known = set()
        self._trees_checked = set()

    def readable_by(self, reader: str, digests: Collection[str]) -> set[str]:
        """Those of ``digests`` granted to ``reader`` (a user, or :func:`worker_reader`)."""
        known = self._readable_known
        if known is None:
            return self.store.readable_blobs(reader, digests)
        found = {d for d in digests if (reader, d) in known}
        if len(found) < len(digests):
            found |= self.store.readable_blobs(reader, [d for d in digests if d not in found])
            self._remember(reader, found)
        return found

    def grant_to(self, reader: str, digests: Collection[str]) -> None:
        """Let ``reader`` read ``digests`` from now on."""
        with self.store.transaction() as tx:
            tx.grant_blobs(reader, digests)
        self._remember(reader, digests)

    def _remember(self, reader: str, digests: Iterable[str]) -> None:
        known = self._readable_known
        if known is not None:
            if len(known) >= _READABLE_KEPT:
                known.clear()
            known.update((reader, d) for d in digests)

    def check_blobs(self, viewer: Viewer, spec: JobSpec, artifacts: ArtifactStore) -> None:
        """Refuse (SpecError) a spec naming a blob ``viewer`` may not read: its
        bundle, an input, a file a manifest of either lists. Worded as for a
        blob not on the server, which is refused the same way."""
        if sees_all(viewer):
            return
        user = viewer.user
        assert user is not None
        roots: dict[str, str] = {}  # field -> manifest
        files: dict[str, str] = {}
        if spec.bundle is not None:
            roots["bundle"] = spec.bundle
        for name, ref in spec.inputs.items():
            (roots if ref.kind == "dir" else files)[f"inputs.{name}"] = ref.digest
        checked = self._trees_checked
        if checked is None:
            checked = self._trees_checked = set()
        roots = {f: d for f, d in roots.items() if (user, d) not in checked}
        if not roots and not files:
            return  # the usual submit: a bundle its user sent before
        named = {**roots, **files}
        # The roots first: a manifest is read only once its user may read it,
        # so how long reading another user's takes cannot show.
        readable = self.readable_by(user, set(named.values()))
        for field, digest in named.items():
            if digest not in readable:
                raise SpecError(field, _not_here(digest))
        for field, root in roots.items():
            listed = self._tree(root, artifacts)
            if listed is None:  # gone, or no manifest: its worker will say so
                continue
            absent = listed - self.readable_by(user, listed)
            if absent:
                kind = "bundle" if field == "bundle" else "folder"
                raise SpecError(field, f"the {kind} lists a file whose {_not_here(min(absent))}")
            if len(checked) >= _TREES_CHECKED_KEPT:
                checked.clear()
            checked.add((user, root))

    def _tree(self, root: str, artifacts: ArtifactStore) -> frozenset[str] | None:
        """The blobs manifest ``root`` lists (kept a while: a manifest never
        changes); None if it is not stored, or is no manifest."""
        with self._lock:
            listed = self._listed.get(root)
        if listed is None:  # read outside the lock: a manifest may be large
            try:
                entries = bundle.load(artifacts, root).entries
            except GPUlayerError:
                return None
            listed = frozenset(e.digest for e in entries if e.digest is not None)
            with self._lock:
                self._listed.put(root, listed)
        return listed

    def _grant_outputs(self, result: TaskResult, run: Running) -> None:
        """Before ``result`` is applied: let its job's user read its outputs,
        and every file of a folder output, as far as its worker proved it
        holds them. Only for a result its job takes: the current attempt's,
        from a worker running one of its tasks."""
        artifacts, uploader, user = self._outputs_from, self._uploader, run.user
        if artifacts is None or uploader is None or user is None or not result.outputs:
            return
        with self._lock:
            task = run.task_on(result.worker_id)
            if (
                self._running.get(result.job_id) is not run
                or run.attempt != result.attempt
                or task is None
                or task.ended
            ):
                return  # it changes nothing (see task_finished)
        prover = uploader(result.worker_id)

        def proved(digests: Collection[str]) -> Collection[str]:
            return digests if prover is None else self.readable_by(prover, digests)

        roots = proved({ref.digest for ref in result.outputs.values()})
        digests = set(roots)
        for ref in result.outputs.values():
            if ref.kind == "dir" and ref.digest in roots:
                try:  # not kept with the bundles' lists: no worker fetches an output
                    entries = bundle.load(artifacts, ref.digest).entries
                except GPUlayerError:
                    continue  # not stored, or no manifest: nothing in it to read
                digests.update(proved({e.digest for e in entries if e.digest is not None}))
        if digests:
            self.grant_to(user, digests)

    def _proved_scratch(self, result: TaskResult) -> ArtifactRef | None:
        """``result.scratch`` if its worker proved it holds the folder and
        every file in it (its own uploads, as for outputs; a worker an
        admin's token registered is trusted): else None, and the job's
        next attempt gets the scratch kept before. A worker cannot name
        another job's blobs for its job's next attempt, on another worker,
        to read."""
        ref = result.scratch
        if ref is None or ref.kind != "dir":
            return None
        artifacts, uploader = self._outputs_from, self._uploader
        if artifacts is None:
            return ref  # no rights kept (embedded, no auth): one user, every blob
        prover = uploader(result.worker_id) if uploader is not None else None
        try:
            entries = bundle.load(artifacts, ref.digest).entries
        except GPUlayerError:
            return None  # not stored, or no manifest
        wanted = {ref.digest} | {e.digest for e in entries if e.digest is not None}
        if prover is not None and set(self.readable_by(prover, wanted)) != wanted:
            log.warning(
                "worker %s named a scratch folder it did not upload; kept the one before",
                result.worker_id,
            )
            return None
        return ref


def _not_here(digest: str) -> str:
    return f"blob {digest} is not on this server; upload it first (PUT /api/v1/blobs/{digest})"


__all__ = ["BlobReaders", "Uploader", "worker_reader"]
