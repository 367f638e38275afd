"""The data folders a runtime gives a session, beside its start spec (protocol.messages.StartSpec):
what agent.lifecycle's folder stage made on the node (agent.files) and both runtimes mount or show.
Its own module so that the runtimes (agent.runtimes, agent.docker_runtime) and the lifecycle that
drives them share the type without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Folders:
    """A session's data folders on its node: `data_dir`, its owner's persistent folder (seen at
    ~/data; None: the node keeps none); `project_dirs`, name → its projects' folders (seen at
    ~/projects/<name>); `shared_dirs`, name → (folder, read-only) of the folders shared with its
    owner (issue 36.5; seen at ~/shared/<name>, a read-only one mounted read-only). The process
    runtime links them into the session's home (and its sandbox mounts them); the docker runtime
    bind-mounts them."""

    data_dir: Path | None = None
    project_dirs: dict[str, Path] = field(default_factory=dict)
    shared_dirs: dict[str, tuple[Path, bool]] = field(default_factory=dict)

    def writable(self) -> list[Path]:
        """The folders the session may write to: its ~/data, its projects', the read-write shares'."""
        data = [self.data_dir] if self.data_dir is not None else []
        return [*data, *self.project_dirs.values(), *(path for path, read_only in self.shared_dirs.values() if not read_only)]

    def read_only(self) -> list[Path]:
        """The read-only shares' folders."""
        return [path for path, read_only in self.shared_dirs.values() if read_only]

    def all(self) -> list[Path]:
        """Every folder: ~/data, the projects', the shares'."""
        data = [self.data_dir] if self.data_dir is not None else []
        return [*data, *self.project_dirs.values(), *(path for path, _ in self.shared_dirs.values())]


NO_FOLDERS = Folders()  # a session given no data folder (a node without a data root)
