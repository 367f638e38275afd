"""Where a session's data folders live (issue 37.3): its owner's ~/data (`<data-root>/users/<user id>`)
and project folders (`<data-root>/projects/<project id>`), which every session gets, are the same
folders on every node whose agent.toml says `[storage] shared = true` (one NFS or CephFS mount at
`data-root` on each of them: `Node.shared_storage`), and a folder of that node's own disk elsewhere.

The scheduler keeps sessions on the nodes with shared storage where their scope has some
(`accelerators.allocation.core.storage_scope`); a session that lands on a node without it, on a
cluster of more than one node, is told so in words (`folders_note`): in the launch preview
(`storage_note`) and on the session's page and in the API (`data_folders_note`). A cluster of one
node says nothing: there is no other folder to confuse it with.
"""

from __future__ import annotations

from accelerators.models import Node


def folders_note(*, node: str, shared: bool, nodes_registered: int) -> str:
    """The sentence telling a session on `node` where its data folders are ("" when there is
    nothing to tell: the node has shared storage, or it is the only node registered)."""
    if shared or nodes_registered < 2:
        return ""
    return (
        f"~/data and the project folders are local to node {node} (its own disk, no shared storage): "
        f"a session on another node sees other folders, and their files are reached only while {node} is up"
    )


def folders_note_for(*, node: Node | None, nodes_registered: int | None = None) -> str:
    """`folders_note` for a session placed on `node` (None: not placed yet, ""); `nodes_registered`
    the number of nodes (None: counted now, one query, only for a node without shared storage)."""
    if node is None or node.shared_storage:
        return ""
    if nodes_registered is None:
        nodes_registered = Node.objects.count()
    return folders_note(node=node.name, shared=False, nodes_registered=nodes_registered)


def folders_note_named(name: str | None) -> str:
    """`folders_note_for` of the node named `name` (None, or a node no longer registered: "").
    At most two queries."""
    if not name:
        return ""
    return folders_note_for(node=Node.objects.filter(name=name).first())
