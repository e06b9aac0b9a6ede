"""From kernel template to loaded kernel: rendering (:mod:`.templates`) and NVRTC compiling (:mod:`.compiler`)."""
