"""The quantization pipeline: recipes become a list of stages that the engine walks (`engine`); the built-in
stages it runs are registered by `builtins.register_builtins`."""
