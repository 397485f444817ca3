"""Imported first by a test server (``start_server(preload=...)``): its soft file-descriptor limit
is 300, as under ``ulimit -n 300``; front-end processes inherit it."""

import resource

SOFT_NOFILE = 300
_, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT_NOFILE, _hard))
