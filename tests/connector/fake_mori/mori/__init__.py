"""A fake of AMD's `mori` package (tests only): no GPU or RDMA here, and vLLM's MoRIIO scheduler side never calls it."""
