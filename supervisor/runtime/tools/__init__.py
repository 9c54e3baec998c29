"""One module per tool; `runtime.registry` lists them."""
