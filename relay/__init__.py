"""The relay: the kit's only public endpoint, joining notebook stages that cannot accept connections."""
