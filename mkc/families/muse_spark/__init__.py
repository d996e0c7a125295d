"""Muse Spark (`muse_spark`, Muse-Spark-Open-816B-A42B): GQA attention, windowed with rotary
embedding on three of four layers and full without it on the fourth, a latent MoE, gated
norm-preserving residuals. Its composition from the layer library is being built; until it
defines `FAMILY` the registry skips the package."""
