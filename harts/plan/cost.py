from harts.config.costs import (  # noqa: F401
    TINY_PAIR_WEIGHT,
    LoadModel,
    LoadModelName,
    TokenCost,
    TokenPairCost,
    default_load_model,
    known_load_models,
    make_load_model,
    register_load_model,
)
