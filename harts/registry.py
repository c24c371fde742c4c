from harts.config.registry import Registry  # noqa: F401
