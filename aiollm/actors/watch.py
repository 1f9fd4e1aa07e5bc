"""Who watches whom, so each watcher gets exactly one `Terminated` per watched actor.

Local watchers of a local actor are told directly; a peer watching one of our actors is sent a
`Stopped` frame. For remote targets the node sends one `Watch` per target URL, however many local
actors watch it, and fires `Terminated` for all of them when the `Stopped` frame arrives or the
connection to that node is lost (closed, or silent past the heartbeat timeout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiollm.actors.messages import PROTOCOL_VERSION, Stopped

if TYPE_CHECKING:
    from aiollm.actors.cell import ActorCell
    from aiollm.actors.peer import Peer


class Watches:
    """The watch tables of one node."""

    def __init__(self) -> None:
        # local actor name -> local actors watching it
        self._local: dict[str, set[ActorCell]] = {}
        # local actor name -> peers watching it
        self._peers: dict[str, set[Peer]] = {}
        # remote node url -> {remote actor url -> local actors watching it}
        self._remote: dict[str, dict[str, set[ActorCell]]] = {}

    def add_local(self, target: str, watcher: ActorCell) -> None:
        self._local.setdefault(target, set()).add(watcher)

    def add_remote(self, node_url: str, url: str, watcher: ActorCell) -> bool:
        """Record a watch on a remote actor; True if it is the first for that URL (send `Watch`)."""
        targets = self._remote.setdefault(node_url, {})
        first = url not in targets
        targets.setdefault(url, set()).add(watcher)
        return first

    def remove(self, watcher: ActorCell, url: str, name: str, node_url: str | None) -> bool:
        """Forget one watch; for a remote target, True if it was the last for that URL (send `Unwatch`)."""
        if node_url is None:
            self._local.get(name, set()).discard(watcher)
            return False
        watchers = self._remote.get(node_url, {}).get(url)
        if watchers is None:
            return False
        watchers.discard(watcher)
        if watchers:
            return False
        del self._remote[node_url][url]
        return True

    def add_remote_watcher(self, target: str, peer: Peer) -> None:
        """A peer watches one of our actors; answered at once if it is not (or no longer) here."""
        actor = peer.node.actors.get(target)
        if actor is None or actor.mailbox.closed:
            peer.notify(Stopped(PROTOCOL_VERSION, target, "not found"))
            return
        self._peers.setdefault(target, set()).add(peer)

    def remove_remote_watcher(self, target: str, peer: Peer) -> None:
        self._peers.get(target, set()).discard(peer)

    async def local_stopped(self, actor: ActorCell, reason: str) -> list[tuple[str, str]]:
        """A local actor stopped: tell its watchers; returns (node_url, url) of remote watches it held
        that nobody holds any more (the node sends `Unwatch` for them)."""
        url = actor.ref.url
        for watcher in self._local.pop(actor.name, ()):
            watcher.deliver_terminated(url, reason)
        for peer in self._peers.pop(actor.name, ()):
            if not peer.closed:
                await peer.send_quiet(Stopped(PROTOCOL_VERSION, actor.name, reason))
        for watchers in self._local.values():
            watchers.discard(actor)
        orphaned = []
        for node_url, targets in self._remote.items():
            for target_url, watchers in list(targets.items()):
                watchers.discard(actor)
                if not watchers:
                    del targets[target_url]
                    orphaned.append((node_url, target_url))
        return orphaned

    def remote_stopped(self, node_url: str, name: str, reason: str) -> None:
        """A `Stopped` frame arrived for one remote actor."""
        url = f"{node_url}/{name}"
        for watcher in self._remote.get(node_url, {}).pop(url, ()):
            watcher.deliver_terminated(url, reason)

    def node_lost(self, node_url: str, peer: Peer, reason: str) -> None:
        """The connection to a node dropped: every actor watched there is gone for us."""
        for url, watchers in self._remote.pop(node_url, {}).items():
            for watcher in watchers:
                watcher.deliver_terminated(url, reason)
        for peers in self._peers.values():
            peers.discard(peer)
