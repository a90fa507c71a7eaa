"""Below the command line: run settings and profiles, model layers, quantization, model
families, sampling, the engine and runs over several processes."""
