"""The model side: the one transformers adapter (architecture registry, attention hook, weight layout) and our
decoder forward for the Llama family. engine.cache never imports this package; it is driven by it."""
