"""The worker contract on the wire (docs/CONTRACT.md): frames, codes and the numpy-only client.

Nothing here imports torch: the proxy process uses this package.
"""

from draftrelay.wire.client import (
    Block,
    BlockResult,
    DrafterClient,
    StepReply,
    WireBadReply,
    WireBreakerOpen,
    WireDisconnected,
    WireError,
    WireRefused,
    WireRemoteError,
    WireTimeout,
)

__all__ = ["Block", "BlockResult", "DrafterClient", "StepReply", "WireBadReply", "WireBreakerOpen",
           "WireDisconnected", "WireError", "WireRefused", "WireRemoteError", "WireTimeout"]
