"""Generated gRPC code for scorer.v1 (make proto); do not edit."""
