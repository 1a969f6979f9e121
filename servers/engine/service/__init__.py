"""The engine server's gRPC services and their converters: the only engine code that imports
the generated protobuf. ``data_plane``, ``control_plane`` and ``status`` are the servicers,
thin: validate (``validate``), call the domain, convert (``data_convert``, ``control_convert``,
``chat_convert``). ``stream_steps`` turns the engine's outputs into stream messages (on the
engine's loop), ``batch_run`` runs one call's many requests, ``push_socket`` (with
``frame_buffers``) takes in-band weights without gRPC's runtime."""
