"""What the engine server and the router share: interceptors (error mapping, bearer tokens),
how a process listens (options, TLS), process plumbing (logging, lifecycle lines, signals),
kept background tasks, and answering a client stream early. Never imports ``engine`` or
``router``."""
