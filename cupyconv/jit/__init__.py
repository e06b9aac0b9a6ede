"""Turning kernel templates into loaded kernels: rendering (:mod:`.templates`) and NVRTC compiling (:mod:`.compiler`)."""
