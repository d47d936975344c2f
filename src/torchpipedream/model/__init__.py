"""What the model is and costs: the layer graph, profiles (measured, PipeDream's graph.txt,
bundled references), capture by torch.fx/export, the profiler, layer splitting, the split
backward, and a model's state_dict as a plain file (state_files)."""
