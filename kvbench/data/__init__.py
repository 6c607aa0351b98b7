"""Datasets: texts and task rows with a public source, a pinned checksum and a local-file
fallback.  :mod:`kvbench.data.catalog` names them, :mod:`kvbench.data.loaders` loads them,
:mod:`kvbench.data.hub` holds the hub access rules.  Import the submodule you need; this
package defines nothing."""
