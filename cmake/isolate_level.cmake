# Joins one CPU level's kernel objects into one relocatable object and gives its weak symbols a prefix of their own.
#
#   cmake -DOBJECTS=a.o;b.o -DOUTPUT=out.o -DPREFIX=attnpp_avx2. -DLINKER=ld -DNM=nm -DOBJCOPY=objcopy -P this
#
# Inline and template functions (Eigen's, the standard library's, attnpp's own) are emitted in every object that
# uses them as weak symbols, and the linker keeps one copy of each. Compiled once per CPU level, the copies
# differ: the kept one could be the AVX-512 copy, called from the baseline path of a CPU without AVX-512. The
# level's own entry points are strong symbols in its namespace (cpu_avx2::kernels) and keep their names.
# Undefined symbols (libc, libgomp, the level-independent parts of attnpp) are left alone.
execute_process(COMMAND "${LINKER}" -r -o "${OUTPUT}.joined" ${OBJECTS} RESULT_VARIABLE status)
if(status)
  message(FATAL_ERROR "${LINKER} -r failed for ${OUTPUT}")
endif()
execute_process(COMMAND "${NM}" --defined-only -P "${OUTPUT}.joined" OUTPUT_VARIABLE symbols RESULT_VARIABLE status)
if(status)
  message(FATAL_ERROR "${NM} failed on ${OUTPUT}.joined")
endif()
string(REPLACE "\n" ";" lines "${symbols}")
set(renames "")
foreach(line IN LISTS lines)
  # nm -P: "name type value size"; W/V: weak function/object, u: unique global (a static of an inline function)
  if(line MATCHES "^([^ ]+) [WVu] ")
    string(APPEND renames "${CMAKE_MATCH_1} ${PREFIX}${CMAKE_MATCH_1}\n")
  endif()
endforeach()
file(WRITE "${OUTPUT}.renames" "${renames}")
execute_process(COMMAND "${OBJCOPY}" "--redefine-syms=${OUTPUT}.renames" "${OUTPUT}.joined" "${OUTPUT}"
                RESULT_VARIABLE status)
if(status)
  message(FATAL_ERROR "${OBJCOPY} failed for ${OUTPUT}")
endif()
