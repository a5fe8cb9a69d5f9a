"""Experts: where each one lives (cache), how hot it is (profile), and running them."""
