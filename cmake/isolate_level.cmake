# Joins one CPU level's kernel objects into one relocatable object and gives its weak symbols a prefix of their own.
#
#   cmake -DOBJECTS=a.o;b.o -DOUTPUT=out.o -DPREFIX=attnpp_avx2. -DLINKER=ld -DNM=nm -DREADELF=readelf
#         -DOBJCOPY=objcopy -P this
#
# Inline and template functions (Eigen's, the standard library's, attnpp's own) are emitted in every object that
# uses them as weak symbols, and the linker keeps one copy of each. Compiled once per CPU level, the copies
# differ: the kept one could be the AVX-512 copy, called from the baseline path of a CPU without AVX-512. The
# COMDAT groups that hold them are renamed too: the linker keeps one group per name and drops the sections of the
# others, with the symbols defined there (a destructor's D5 group, whose signature is a local symbol, left
# renamed D1/D2 destructors undefined, and a null pointer called at exit). The level's own entry points are
# strong symbols in its namespace (cpu_avx2::kernels) and keep their names.
# Undefined symbols (libc, libgomp, the level-independent parts of attnpp) are left alone.
execute_process(COMMAND "${LINKER}" -r -o "${OUTPUT}.joined" ${OBJECTS} RESULT_VARIABLE status)
if(status)
  message(FATAL_ERROR "${LINKER} -r failed for ${OUTPUT}")
endif()
execute_process(COMMAND "${NM}" --defined-only -P "${OUTPUT}.joined" OUTPUT_VARIABLE symbols RESULT_VARIABLE status)
if(status)
  message(FATAL_ERROR "${NM} failed on ${OUTPUT}.joined")
endif()
execute_process(COMMAND "${READELF}" -gW "${OUTPUT}.joined" OUTPUT_VARIABLE groups RESULT_VARIABLE status)
if(status)
  message(FATAL_ERROR "${READELF} failed on ${OUTPUT}.joined")
endif()
set(names "")
string(REPLACE "\n" ";" lines "${symbols}")
foreach(line IN LISTS lines)
  # nm -P: "name type value size"; W/V: weak function/object, u: unique global (a static of an inline function)
  if(line MATCHES "^([^ ]+) [WVu] ")
    list(APPEND names "${CMAKE_MATCH_1}")
  endif()
endforeach()
string(REPLACE "\n" ";" lines "${groups}")
foreach(line IN LISTS lines)
  # readelf -g: "COMDAT group section [    2] `.group' [signature] contains 2 sections:"
  if(line MATCHES "^COMDAT group section .* \\[([^ ]+)\\] contains")
    list(APPEND names "${CMAKE_MATCH_1}")
  endif()
endforeach()
list(REMOVE_DUPLICATES names)
set(renames "")
foreach(name IN LISTS names)
  string(APPEND renames "${name} ${PREFIX}${name}\n")
endforeach()
file(WRITE "${OUTPUT}.renames" "${renames}")
execute_process(COMMAND "${OBJCOPY}" "--redefine-syms=${OUTPUT}.renames" "${OUTPUT}.joined" "${OUTPUT}"
                RESULT_VARIABLE status)
if(status)
  message(FATAL_ERROR "${OBJCOPY} failed for ${OUTPUT}")
endif()
# Every group and weak symbol of the result carries the prefix, or the build stops here rather than at a SIGILL.
execute_process(COMMAND "${READELF}" -gW "${OUTPUT}" OUTPUT_VARIABLE groups)
execute_process(COMMAND "${NM}" --defined-only -P "${OUTPUT}" OUTPUT_VARIABLE symbols)
string(REPLACE "." "\\." prefix_regex "${PREFIX}")
string(REPLACE "\n" ";" lines "${groups}\n${symbols}")
foreach(line IN LISTS lines)
  set(name "")
  if(line MATCHES "^COMDAT group section .* \\[([^ ]+)\\] contains")
    set(name "${CMAKE_MATCH_1}")
  elseif(line MATCHES "^([^ ]+) [WVu] ")
    set(name "${CMAKE_MATCH_1}")
  endif()
  if(name AND NOT name MATCHES "^${prefix_regex}")
    message(FATAL_ERROR "${OUTPUT}: ${name} was not renamed")
  endif()
endforeach()
