"""Bundles on the move: partial bundles joined (`merge`), one file to ship (`pack`/`unpack`), and the part
of a published bundle one machine can use (`fetch`).

A layer of its own between the halves and the kinds: the runtime's loader calls `fetch.resolve` to turn a
pack or an `hf://` address into a local bundle directory, so nothing here imports `runtime/` or
`pipeline/`. Every refusal is a `manifest.BundleError` naming the cause and the fix, and leaves nothing
behind: what is written goes through `staging` (a directory beside the target, renamed into place).

The addresses a bundle travels under are spelled here once; this module imports nothing, so the command
line can ask without loading the layer.
"""

HF_SCHEME = "hf://"  # hf://ORG/REPO[/PATH][@REVISION]: a bundle published on the Hugging Face Hub
PACK_SUFFIX = ".tar.zst"  # a pack: the bundle as one zstd-compressed tar, bundle.json first

__all__ = ["HF_SCHEME", "PACK_SUFFIX"]
