"""Who may read which blob, for the users of a server with auth.

Blobs are content-addressed and shared: one stored copy serves every job
that names its digest. A digest is therefore no right to read a blob: it can
be guessed (the sha256 of a short secret file can be tried in a few
requests). A user may read a blob once the server has seen that user hold
its bytes:

1. they uploaded it, every byte, verified against the digest (also when the
   blob was stored already: see ``http/app.py``);
2. a job of theirs produced it: an output, or a file of a folder output,
   recorded when the server accepts the task's result (:meth:`_grant_outputs`).

The right is kept per user name (``blob_readers`` in the store) and never
taken back: a user who held the bytes once knows them. Admins read every
blob; a worker fetches what its tasks were given (``may_fetch``).

A job is refused at submit if it names a blob its user may not read (its
bundle, an input, or a file a manifest of either lists): else running it
would read the blob (``cat`` an input), and whether it ran would tell that
the blob exists. The refusal says what it says for a blob not on the server.

Embedded, and on a server without auth, none of this runs: one local user
sees everything.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from .. import bundle
from ..access import Viewer, sees_all
from ..artifacts import ArtifactStore
from ..errors import GPUlayerError, SpecError
from ..jobs import TaskResult
from ..spec import JobSpec
from .core import PlaneCore
from .state import Running

# (user, manifest) pairs known to be readable whole, each a few hundred
# bytes: a submit of a bundle its user sent before then costs no store read.
# Emptied when full: a pair checked again costs two reads.
_TREES_CHECKED_KEPT = 100_000


class BlobReaders(PlaneCore):
    # Set by keep_blob_readers (a server with auth): where outputs' manifests
    # are read. None: no rights are kept, nor needed.
    _outputs_from: ArtifactStore | None = None
    _trees_checked: set[tuple[str, str]]

    def keep_blob_readers(self, artifacts: ArtifactStore) -> None:
        """Grant each job's user its outputs as its tasks' results come
        (reading folder outputs' manifests from ``artifacts``)."""
        self._outputs_from = artifacts
        self._trees_checked = set()

    def readable(self, viewer: Viewer, digests: Collection[str]) -> set[str]:
        """Those of ``digests`` that ``viewer`` may read (whether stored or not)."""
        if sees_all(viewer):
            return set(digests)
        assert viewer.user is not None  # only an admin has none
        return self.store.readable_blobs(viewer.user, digests)

    def grant(self, viewer: Viewer, digests: Iterable[str]) -> None:
        """Let ``viewer`` read ``digests`` (nothing to keep for one that reads all)."""
        if not sees_all(viewer):
            assert viewer.user is not None
            with self.store.transaction() as tx:
                tx.grant_blobs(viewer.user, digests)

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
        roots = {f: d for f, d in roots.items() if (user, d) not in checked}
        if not roots and not files:
            return  # the usual submit: a bundle its user sent before
        named = {**roots, **files}
        # The roots first: a manifest is read only once its user may read it,
        # so how long reading another user's takes cannot show.
        readable = self.readable(viewer, set(named.values()))
        for field, digest in named.items():
            if digest not in readable:
                raise SpecError(field, _not_here(digest))
        for field, root in roots.items():
            listed = self._tree(root, artifacts)
            if listed is None:  # gone, or no manifest: its worker will say so
                continue
            absent = listed - self.readable(viewer, listed)
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
        and every file of a folder output, so that a client told the job
        ended can fetch them at once. Only for a result its job takes: the
        current attempt's, from a worker running one of its tasks."""
        artifacts, user = self._outputs_from, run.user
        if artifacts is None or user is None or not result.outputs:
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
        digests = set()
        for ref in result.outputs.values():
            digests.add(ref.digest)
            if ref.kind == "dir":
                try:  # not kept with the bundles' lists: no worker fetches an output
                    entries = bundle.load(artifacts, ref.digest).entries
                except GPUlayerError:
                    continue  # not stored: there is nothing in it to read
                digests.update(e.digest for e in entries if e.digest is not None)
        with self.store.transaction() as tx:
            tx.grant_blobs(user, digests)


def _not_here(digest: str) -> str:
    return f"blob {digest} is not on this server; upload it first (PUT /api/v1/blobs/{digest})"


__all__ = ["BlobReaders"]
