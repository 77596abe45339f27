"""OCI registries as the distribution channel for bundles and the shared tier of the build
cache: a small distribution client (client.py), credentials as Docker keeps them
(credentials.py), references (reference.py), folders as artifacts (artifact.py), bundles
(bundles.py) and the remote cache tier (remote_cache.py)."""
