"""Where a catching-up reader gets a version's files: the fetch-source port and its adapters.

The object store stays the origin and the source of truth. A `FetchSource` is any other
place that may hold the same files under the same keys (a peer agent, an HTTP cache or
P2P distributor, an S3-compatible regional cache); `SourcedFetch` tries them in order and
accepts bytes only when they match the size and digest the store recorded for the file.
"""

from store.sources.base import FetchSource, SourceFailed
from store.sources.http import HttpSource
from store.sources.objects import ObjectSource
from store.sources.sourced_fetch import FileDigest, FoundSources, SourcedFetch, SourceFault

__all__ = [
    "FetchSource",
    "FileDigest",
    "FoundSources",
    "HttpSource",
    "ObjectSource",
    "SourceFailed",
    "SourceFault",
    "SourcedFetch",
]
