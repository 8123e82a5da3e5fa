"""MLX engine: mlx-lm models whose expert banks are streamed through the cachecd daemon."""
