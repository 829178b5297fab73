"""Model runtime shared by the draft and target services: no grpc, no redis here."""
