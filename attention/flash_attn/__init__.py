"""The FlashAttention backend, by part: the family's flavours and what each accepts
(``flavours``), FlashAttention-4's calls with its tiles and cascade decode (``fa4``), FA3's and
FA2's calls (``fa2_fa3``), and the backend with its state and layer (``backend``)."""
